"""Tensor parallelism through the executors: same tokens as one rank; dead workers fail fast."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
import torch

from platform_core import LLM, SamplingParams
from platform_core.errors import BackendError
from platform_core.executor.base import WorkerDiedError

PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
NO_RAY = "ray is not installed (pip install 'platform-core[ray]')"


def prompts(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 256) for _ in range(40)]
    lengths = (1, 7, 33, 90)
    plain = [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]
    return [{"prompt_token_ids": p} for p in [*plain, shared + [5], shared + [6, 7]]]


def tokens(llm: LLM, batch: list[dict]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(batch, PARAMS, use_tqdm=False)]


@pytest.mark.usefixtures("no_child_processes_left")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp2_multiprocess_equals_one_rank(tiny_model_dir, arch):
    model = str(tiny_model_dir(arch))
    batch = prompts()
    expected = tokens(LLM(model, dtype="float32"), batch)
    with LLM(
        model,
        dtype="float32",
        block_size=16,  # short prompts still fill blocks: prefix-cache hits
        tensor_parallel_size=2,
        max_num_batched_tokens=32,  # chunked prefill
        enable_prefix_caching=True,
    ) as tp:
        assert tokens(tp, batch) == expected
        assert tp.stats()["prefix_cache_hit_tokens"] > 0
        assert tp.engine.runner.model.num_heads == 2  # this rank holds half the heads


def test_tp2_on_ray_equals_one_rank_and_leaves_nothing(tiny_model_dir):
    pytest.importorskip("ray", reason=NO_RAY)
    model = str(tiny_model_dir("llama"))
    batch = prompts(1)
    expected = tokens(LLM(model, dtype="float32"), batch)
    tp = LLM(model, dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        assert tokens(tp, batch) == expected
        worker_pids = tp.engine.executor.worker_pids
        # both ranks on this machine: they split its cores
        assert torch.get_num_threads() == max(1, (os.cpu_count() or 1) // 2)
    finally:
        tp.shutdown()
    import ray

    assert not ray.is_initialized()
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in worker_pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in worker_pids), "a Ray worker outlived shutdown"


def test_a_ray_rank_failing_to_start_fails_the_driver_at_once(tiny_model_dir):
    ray = pytest.importorskip("ray", reason=NO_RAY)
    # The actors' environment names a CPU kernel level that does not exist: their backend
    # refuses it, while the driver's (this process's) is fine.
    ray.init(
        address="local",
        _node_ip_address="127.0.0.2",
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PLATFORM_CORE_CPU_ISA": "no-such-level"}},
    )
    try:
        # Without the watch the driver would wait out the rendezvous and raise ProcessStartError.
        with pytest.raises(BackendError, match="no-such-level"):
            LLM(
                str(tiny_model_dir("llama")),
                dtype="float32",
                tensor_parallel_size=2,
                distributed_executor_backend="ray",
            )
    finally:
        ray.shutdown()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.usefixtures("no_child_processes_left")
def test_killed_worker_fails_requests_quickly(tiny_model_dir):
    llm = LLM(
        str(tiny_model_dir("llama")),
        dtype="float32",
        tensor_parallel_size=2,
        worker_timeout_s=60,  # for the start on a busy machine; a death is seen at once
    )
    try:
        worker = llm.engine.executor._procs[0]
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        threading.Timer(1.0, os.kill, (worker.pid, signal.SIGKILL)).start()
        started = time.monotonic()
        with pytest.raises(WorkerDiedError):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 4, params, use_tqdm=False)
        assert time.monotonic() - started < 15
        assert not llm.engine.has_unfinished_requests()
        assert llm.stats()["kv_blocks_used"] == 0
    finally:
        llm.shutdown()
