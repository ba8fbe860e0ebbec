"""Engine side of hostile load (issue #27): aborts at scale, huge id lists, seed overflow,
deadlines during acceptance, per-stream buffering and back-pressure, dead workers while idle."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
import torch
from server_utils import engine_config, engine_idle, wait_for

from platform_core import LLM, SamplingParams
from platform_core.config import CacheConfig, SchedulerConfig
from platform_core.engine.async_engine import AsyncEngine
from platform_core.engine.core import IDLE_HEALTH_CHECK_S
from platform_core.engine.outputs import CompletionOutput, RequestOutput
from platform_core.engine.request_stream import GenerateRequest, StreamSink
from platform_core.errors import (
    DeadlineExceededError,
    EngineDeadError,
    RequestFailedError,
    StreamBackpressureError,
)
from platform_core.sample.metadata import GeneratorStore, SampleRow, build_sampling_metadata
from platform_core.scheduler.request import Request
from platform_core.scheduler.scheduler import Scheduler

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(
        str(tiny_model_dir("llama")), dtype="float32", num_gpu_blocks_override=64, block_size=16
    )


@pytest.fixture(scope="module")
def async_engine(tiny_model_dir):
    engine = AsyncEngine.from_config(
        engine_config(tiny_model_dir("llama"), max_model_len=512, max_num_seqs=16)
    )
    yield engine
    engine.shutdown()


def assert_clean(llm: LLM) -> None:
    llm.check_kv_integrity()
    assert llm.stats()["kv_blocks_used"] == 0
    assert not llm.engine.has_unfinished_requests()


def tokens_of(llm: LLM, params: SamplingParams, prompt: list[int]) -> list[list[int]]:
    (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return [c.token_ids for c in output.outputs]


# ---------------------------------------------------------------- 1. aborting at scale


def test_aborting_50000_waiting_requests_at_once_leaves_the_engine_serving(llm):
    engine = llm.engine
    ids = [f"flood-{i}" for i in range(50_000)]
    for request_id in ids:
        engine.add_request(request_id, None, GREEDY, prompt_token_ids=[5, 6, 7])
    engine.step()  # some run, most wait
    assert engine.scheduler.num_waiting > 40_000
    started = time.monotonic()
    engine.abort_request(ids[::-1])  # the tail first: the worst order for a list removal
    elapsed = time.monotonic() - started
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.num_waiting == engine.scheduler.num_running == 0
    assert_clean(llm)
    # Liveness, generously: before the fix this call took minutes (O(n^2) deque removals).
    assert elapsed < 10, elapsed
    assert len(tokens_of(llm, GREEDY, [8, 9])[0]) == GREEDY.max_tokens


def _abort_cost(n: int) -> float:
    """Seconds to abort all of ``n`` waiting requests, tail first, in one call (best of 3)."""
    params = SamplingParams()
    best = float("inf")
    for _ in range(3):
        scheduler = Scheduler(SchedulerConfig(), CacheConfig(block_size=16), 64)
        for i in range(n):
            scheduler.add_request(
                Request(request_id=f"r{i}", prompt_token_ids=[1, 2], sampling_params=params)
            )
        ids = [f"r{i}" for i in reversed(range(n))]
        started = time.perf_counter()
        scheduler.abort(ids)
        best = min(best, time.perf_counter() - started)
        assert scheduler.num_unfinished == 0 and not scheduler.requests
    return best


def test_abort_cost_grows_linearly_with_the_queue():
    # Linear: 4x the requests cost about 4x. Removing each from a deque costs 16x (quadratic).
    small, large = _abort_cost(4_000), _abort_cost(16_000)
    assert large < 8 * small, (small, large)


def test_aborting_keeps_the_order_of_the_rest():
    scheduler = Scheduler(SchedulerConfig(), CacheConfig(block_size=16), 64)
    for i in range(10):
        scheduler.add_request(
            Request(request_id=f"r{i}", prompt_token_ids=[1], sampling_params=GREEDY)
        )
    scheduler.abort(["r3", "r0", "r9", "r3", "missing"])
    assert [r.request_id for r in scheduler.waiting] == ["r1", "r2", "r4", "r5", "r6", "r7", "r8"]
    assert scheduler.num_waiting == 7


# ---------------------------------------------------------------- 2. huge id lists


def test_id_lists_are_normalized_once_and_shared_by_every_step():
    words = [7, 11, 13]
    params = SamplingParams(
        allowed_token_ids=words * 70_000, stop_token_ids=[5, 9] * 100_000, min_tokens=4
    )
    assert params.allowed_token_ids == words and params.stop_token_ids == [5, 9]
    assert params.stop_token_set == {5, 9}
    fork = params.clone_for_sample(1)
    assert fork.allowed_token_array is params.allowed_token_array

    def step_ids(output_token_ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        row = SampleRow(
            request_id="r",
            sampling_params=params,
            prompt_token_ids=[1],
            output_token_ids=output_token_ids,
        )
        meta = build_sampling_metadata([row], GeneratorStore(), frozenset({2}), torch.device("cpu"))
        (allowed,) = meta.allowed
        return allowed[1], [ids for _, ids in meta.blocked]

    first, blocked = step_ids([])
    later, _ = step_ids([3, 4])
    # Each step views the request's own buffer: nothing proportional to the list is rebuilt.
    address = params.allowed_token_array.buffer_info()[0]
    assert first.data_ptr() == later.data_ptr() == address
    assert first.tolist() == words
    assert sorted(t for ids in blocked for t in ids.tolist()) == [2, 5, 9]


def test_duplicated_id_lists_generate_the_same_tokens(llm):
    prompt = [3, 17, 42, 99]
    allowed = [11, 23, 57, 101, 200]
    stops = [40, 41, 2]
    bias = {i: 0.5 for i in range(0, 256, 3)}
    plain = SamplingParams(
        temperature=0.0,
        max_tokens=10,
        allowed_token_ids=allowed,
        stop_token_ids=stops,
        min_tokens=3,
        logit_bias=bias,
    )
    flooded = SamplingParams(
        temperature=0.0,
        max_tokens=10,
        allowed_token_ids=allowed * 40_000,
        stop_token_ids=stops * 50_000,
        min_tokens=3,
        logit_bias=bias,
    )
    expected = tokens_of(llm, plain, prompt)
    assert all(t in allowed for t in expected[0])
    assert tokens_of(llm, flooded, prompt) == expected
    # A (repeated) stop token ends the request at once.
    free = tokens_of(llm, SamplingParams(temperature=0.0, max_tokens=10), prompt)[0]
    stop_on = SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[free[0]] * 9)
    assert tokens_of(llm, stop_on, prompt) == [free[:1]]
    assert_clean(llm)


# ---------------------------------------------------------------- 3. seeds at the edges


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63 - 1), 0, -5])
def test_forked_samples_of_any_valid_seed_run_and_repeat(llm, seed):
    params = SamplingParams(temperature=1.0, max_tokens=5, n=4, seed=seed, ignore_eos=True)
    forks = [params.clone_for_sample(i).seed for i in range(4)]
    assert len(set(forks)) == 4 and all(abs(s) < 2**63 for s in forks)
    first = tokens_of(llm, params, [4, 5, 6])
    assert len(first) == 4 and all(len(t) == 5 for t in first)
    assert tokens_of(llm, params, [4, 5, 6]) == first
    assert_clean(llm)


def test_fork_seeds_are_unchanged_where_they_did_not_overflow():
    params = SamplingParams(n=3, seed=1234)
    assert [params.clone_for_sample(i).seed for i in range(3)] == [1234, 1235, 1236]
    assert params.clone_for_sample(2).n == 1 and params.n == 3


# ---------------------------------------------------------------- 4. deadline on acceptance


def test_deadline_covers_the_wait_for_acceptance(async_engine):
    inner = async_engine.engine
    real_step = inner.step
    entered, release = threading.Event(), threading.Event()

    def slow_step():
        if not release.is_set():
            entered.set()
            release.wait(10)  # a long prefill step, bounded
        return real_step()

    inner.step = slow_step
    long = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    async def drain(request_id: str) -> None:
        stream = await async_engine.submit([GenerateRequest(request_id, None, long, [5, 6])])
        async for _ in stream:
            pass

    async def run() -> float:
        blocker = asyncio.create_task(drain("blocker"))
        assert await asyncio.to_thread(entered.wait, 10)
        started = time.monotonic()
        late = GenerateRequest("late", None, long, [7, 8], deadline=started + 0.3)
        with pytest.raises(DeadlineExceededError):
            await async_engine.submit([late, GenerateRequest("late-2", None, long, [9])])
        waited = time.monotonic() - started
        assert not release.is_set()  # raised while the step was still running
        release.set()
        await blocker
        return waited

    try:
        waited = asyncio.run(run())
    finally:
        release.set()
        inner.step = real_step
    assert 0.25 < waited < 5, waited  # before the fix: until the step ended (10 s here)
    wait_for(lambda: engine_idle(async_engine), 10, "the expired submission kept its blocks")
    inner.check_kv_integrity()


# ---------------------------------------------------------------- 5. buffering per stream


def _output(request_id: str, num_tokens: int, finished: bool = False) -> RequestOutput:
    completion = CompletionOutput(0, "", list(range(num_tokens)), "length" if finished else None)
    return RequestOutput(request_id, None, [1], [completion], finished)


def test_sink_keeps_only_the_newest_output_per_request():
    async def run() -> None:
        aborted: list[list[str]] = []
        sink = StreamSink(asyncio.get_running_loop(), ["a", "b"], aborted.append)
        for n in range(1, 500):
            sink.put(_output("a", n))
            sink.put(_output("b", n))
            assert len(sink.pending) <= 2
        taken = await sink.take()
        assert [(o.request_id, len(o.outputs[0].token_ids)) for o in taken] == [
            ("a", 499),
            ("b", 499),
        ]
        assert not sink.pending and not aborted

    asyncio.run(run())


def test_sink_aborts_past_its_limit_counting_only_tokens_not_taken():
    async def run() -> None:
        aborted: list[list[str]] = []
        sink = StreamSink(asyncio.get_running_loop(), ["a", "b"], aborted.append, 10)
        sink.put(_output("a", 6))
        sink.put(_output("b", 3, finished=True))
        await sink.take()  # the reader took 9 tokens: they no longer count
        sink.put(_output("a", 16))
        assert not aborted  # 10 buffered: at the limit, not past it
        sink.put(_output("a", 17))
        assert aborted == [["a"]]  # only the unfinished request
        with pytest.raises(StreamBackpressureError, match="11 generated tokens"):
            await sink.take()
        assert not sink.pending

    asyncio.run(run())


def test_a_reader_that_stops_reading_is_aborted_and_its_blocks_freed(async_engine):
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    requests = [GenerateRequest(f"stalled-{i}", None, params, [5 + i, 6, 7]) for i in range(2)]

    async def run() -> int:
        stream = await async_engine.submit(requests, max_buffered_tokens=40)
        outputs = aiter(stream)
        first = await anext(outputs)
        assert not first.finished
        sink, most_pending = stream._sink, 0
        while sink.error is None:  # the reader is gone; watch what the sink keeps
            most_pending = max(most_pending, len(sink.pending))
            await asyncio.sleep(0.002)
        with pytest.raises(StreamBackpressureError) as caught:
            for _ in requests:  # the rest of the batch taken with the first, then the error
                await anext(outputs)
        assert isinstance(caught.value, RequestFailedError)
        return most_pending

    assert asyncio.run(run()) <= len(requests)
    wait_for(lambda: engine_idle(async_engine), 10, "a stalled stream kept its blocks")
    async_engine.engine.check_kv_integrity()


def test_a_reader_that_keeps_up_is_never_cut(async_engine):
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)

    async def collect(prefix: str, limit: int | None) -> list[list[int]]:
        requests = [GenerateRequest(f"{prefix}-{i}", None, params, [9, 8 + i]) for i in range(2)]
        stream = await async_engine.submit(requests, max_buffered_tokens=limit)
        finals = {}
        async for output in stream:
            finals[output.request_id] = output.outputs[0].token_ids
        return [finals[r.request_id] for r in requests]

    unlimited = asyncio.run(collect("free", None))
    limited = asyncio.run(collect("bounded", 40))
    assert limited == unlimited and all(len(t) == 60 for t in limited)
    assert engine_idle(async_engine)


# ---------------------------------------------------------------- 6. a dead worker while idle


def test_an_idle_engine_notices_a_dead_worker(tiny_model_dir):
    engine = AsyncEngine.from_config(
        # The timeout bounds the workers' start (a loaded 2-core CI machine took over 10 s).
        engine_config(tiny_model_dir("llama"), tensor_parallel_size=2, worker_timeout_s=60)
    )
    try:

        async def one() -> RequestOutput:
            last = None
            async for output in engine.generate("before", None, GREEDY, [5, 6]):
                last = output
            return last

        assert asyncio.run(one()).finished
        assert engine.is_running
        os.kill(engine.engine.executor._procs[0].pid, signal.SIGKILL)
        # No request comes: the idle loop's health check must notice on its own.
        wait_for(lambda: not engine.is_running, 10 * IDLE_HEALTH_CHECK_S, "a dead worker unseen")
        assert "worker" in str(engine.error)
        with pytest.raises(EngineDeadError):
            asyncio.run(one())
    finally:
        engine.shutdown()
