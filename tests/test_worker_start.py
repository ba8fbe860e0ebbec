"""Tensor-parallel workers start the way users' code expects, and a worker that dies starting
fails the engine at once with its error.

A plain script with no ``if __name__ == "__main__":`` guard runs TP=2 unchanged (workers fork);
forced to spawn, it fails at once saying what to do. A worker that dies or raises before, during
or after the rendezvous fails ``LLM(...)`` with its exit status or traceback while the driver is
still waiting (the driver's own join never times out first). No test leaves a process behind.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import platform_core.executor.multiproc as multiproc
import platform_core.executor.rank as rank_module
from platform_core import LLM, SamplingParams
from platform_core.distributed.start_method import START_METHOD_ENV
from platform_core.errors import ProcessStartError
from platform_core.executor.base import WorkerDiedError
from tests.multiproc import run_adopting_orphans

pytestmark = pytest.mark.usefixtures("no_child_processes_left")
PROMPTS = ["hi", "The capital of"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SCRIPT_TIMEOUT_S = 300

UNGUARDED_SCRIPT = """\
import json
from platform_core import LLM, SamplingParams
llm = LLM(model={model!r}, tensor_parallel_size=2, dtype="float32"{extra})
outputs = llm.generate({prompts!r}, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
executor = llm.engine.executor
print(json.dumps({{
    "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
    "texts": [o.outputs[0].text for o in outputs],
    "worker_pids": executor.worker_pids,
    "start_method": executor.start_method.name,
}}))
"""

GUARD_PROBE_SCRIPT = """\
import json
from platform_core.distributed.start_method import check_main_survives_spawn
from platform_core.errors import UnguardedMainError

def verdict():
    try:
        check_main_survives_spawn("a test")
    except UnguardedMainError:
        return "refused"
    return "allowed"

def main():
    return verdict()

top_level = verdict()
if __name__ == "__main__":
    print(json.dumps({"top_level": top_level, "guarded": verdict(), "via_function": main()}))
"""


def _script_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != START_METHOD_ENV}
    return {**env, **extra}


def _run_script(tmp_path, text: str, **env: str):
    script = tmp_path / "user_script.py"
    script.write_text(text)
    result, orphans = run_adopting_orphans(
        [sys.executable, str(script)], _script_env(**env), SCRIPT_TIMEOUT_S
    )
    assert not orphans, f"the script left processes running: {orphans}\n{result.stderr[-3000:]}"
    return script, result


@pytest.fixture(scope="module")
def one_rank_outputs(text_model_dir):
    llm = LLM(str(text_model_dir), dtype="float32")
    try:
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outputs], [o.outputs[0].text for o in outputs]


# ---------------------------------------------------------------- user scripts


def test_an_unguarded_script_runs_tensor_parallel_unchanged(
    tmp_path, text_model_dir, one_rank_outputs
):
    text = UNGUARDED_SCRIPT.format(model=str(text_model_dir), prompts=PROMPTS, extra="")
    _, result = _run_script(tmp_path, text)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert (report["token_ids"], report["texts"]) == one_rank_outputs
    assert report["start_method"] == "fork"
    assert len(report["worker_pids"]) == 1
    assert not any(os.path.exists(f"/proc/{pid}") for pid in report["worker_pids"])


@pytest.mark.parametrize(
    ("extra", "env", "reason"),
    [
        (', worker_start_method="spawn"', {}, "spawn requested"),
        ("", {START_METHOD_ENV: "spawn"}, f"spawn ${START_METHOD_ENV}"),
    ],
    ids=["engine-setting", "environment"],
)
def test_an_unguarded_script_forced_to_spawn_fails_at_once_saying_what_to_do(
    tmp_path, text_model_dir, extra, env, reason
):
    text = UNGUARDED_SCRIPT.format(model=str(text_model_dir), prompts=PROMPTS, extra=extra)
    script, result = _run_script(tmp_path, text, **env)
    assert result.returncode == 1
    assert result.stdout == ""
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("platform_core.errors.UnguardedMainError: ")
    assert f"{script}, line 3, starts platform-core's worker processes" in last_line
    assert f"spawned here ({reason})" in last_line
    assert "under 'if __name__ == \"__main__\":'" in last_line
    assert f"{START_METHOD_ENV}=fork" in last_line
    assert "Timed out" not in result.stderr and "bootstrapping" not in result.stderr


def test_the_guard_is_recognised_where_the_call_comes_from(tmp_path):
    _, result = _run_script(tmp_path, GUARD_PROBE_SCRIPT)
    assert result.returncode == 0, result.stderr[-4000:]
    verdicts = json.loads(result.stdout.strip().splitlines()[-1])
    assert verdicts == {"top_level": "refused", "guarded": "allowed", "via_function": "allowed"}


# ---------------------------------------------------------------- in this process


def test_spawned_workers_compute_what_one_rank_does(text_model_dir, one_rank_outputs):
    # pytest's main module is not re-run by spawn, so nothing is refused here
    with LLM(
        str(text_model_dir), dtype="float32", tensor_parallel_size=2, worker_start_method="spawn"
    ) as llm:
        assert llm.engine.executor.start_method.name == "spawn"
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outputs], [o.outputs[0].text for o in outputs]
    assert got == one_rank_outputs


def _exit_7_before_the_rendezvous(monkeypatch):
    real = rank_module.build_rank_runner

    def build(spec, group, rank, while_waiting=None):
        if rank == 1:
            os._exit(7)
        return real(spec, group, rank, while_waiting)

    monkeypatch.setattr(rank_module, "build_rank_runner", build)


def _exit_7_inside_the_rendezvous(monkeypatch):
    # after rank 1 counted itself in: the driver is already inside torch's group set-up
    real = torch.distributed.init_process_group

    def init(*args, rank, **kwargs):
        if rank == 1:
            os._exit(7)
        real(*args, rank=rank, **kwargs)

    monkeypatch.setattr(torch.distributed, "init_process_group", init)


def _raise_while_building_the_rank(monkeypatch):
    real = rank_module.ModelRunner

    def runner(*args, tp, **kwargs):
        if tp.rank == 1:
            raise RuntimeError("injected: rank 1 could not load its shard")
        return real(*args, tp=tp, **kwargs)

    monkeypatch.setattr(rank_module, "ModelRunner", runner)


@pytest.mark.parametrize(
    ("inject", "expected"),
    [
        (_exit_7_before_the_rendezvous, "exited with code 7 before it was ready"),
        (_exit_7_inside_the_rendezvous, "exited with code 7 before it was ready"),
        (_raise_while_building_the_rank, "RuntimeError: injected: rank 1 could not load"),
    ],
    ids=["before-rendezvous", "inside-rendezvous", "building-rank"],
)
def test_a_forked_worker_dying_while_starting_fails_the_engine_at_once(
    monkeypatch, tiny_model_dir, inject, expected
):
    inject(monkeypatch)  # forked workers inherit the patch
    with pytest.raises(WorkerDiedError) as failure:
        LLM(
            str(tiny_model_dir("llama")),
            dtype="float32",
            tensor_parallel_size=2,
            worker_start_method="fork",
            worker_timeout_s=30,
        )
    message = str(failure.value)
    assert message.startswith("platform-core-rank1 (pid ")
    assert expected in message
    assert isinstance(failure.value.__cause__, ProcessStartError)
    if "exited" in expected:  # noticed by the driver's watch, not after its own join failed
        assert failure.value.__cause__.__context__ is None
    assert not torch.distributed.is_initialized()


class _ExitWhenUnpickled:
    """Pickles fine; a spawned child unpickling it exits 7, before any of our code runs there."""

    def __reduce__(self):
        return os._exit, (7,)


def test_a_spawned_worker_dying_before_it_starts_fails_the_engine_at_once(
    monkeypatch, tiny_model_dir
):
    real = multiproc.start_child

    def start_poisoned(target, args, name, method):
        return real(target, (*args, _ExitWhenUnpickled()), name, method)

    monkeypatch.setattr(multiproc, "start_child", start_poisoned)
    with pytest.raises(WorkerDiedError) as failure:
        LLM(
            str(tiny_model_dir("llama")),
            dtype="float32",
            tensor_parallel_size=2,
            worker_start_method="spawn",
            worker_timeout_s=30,
        )
    assert "platform-core-rank1 (pid " in str(failure.value)
    assert "exited with code 7 before it started" in str(failure.value)
    assert failure.value.__cause__.__context__ is None
