"""AsyncEngine: the engine loop on its own thread, fed and read from asyncio."""

from __future__ import annotations

import asyncio
import threading

import pytest
from server_utils import engine_config, engine_idle, wait_for
from text_model import save_text_model

from platform_core import LLM, SamplingParams
from platform_core.engine.async_engine import AsyncEngine
from platform_core.engine.llm_engine import LLMEngine
from platform_core.engine.request_stream import GenerateRequest
from platform_core.errors import ConfigError, EngineDeadError, InvalidRequestError

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5 + i, 40, 17 + 3 * i, 99, 12] for i in range(8)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_text_model(tmp_path_factory.mktemp("async-engine-model"))


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = AsyncEngine.from_config(engine_config(model_dir))
    yield engine
    engine.shutdown()


async def _last(engine: AsyncEngine, request_id: str, prompt: list[int], params=GREEDY):
    last = None
    async for output in engine.generate(request_id, None, params, prompt):
        last = output
    return last


def test_concurrent_requests_share_steps_and_match_the_sync_engine(engine, model_dir):
    before = engine.stats()

    async def run():
        return await asyncio.gather(
            *(_last(engine, f"batch-{i}", p) for i, p in enumerate(PROMPTS))
        )

    outputs = asyncio.run(run())
    after = engine.stats()
    expected = LLM(config=engine_config(model_dir)).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False
    )
    for got, want in zip(outputs, expected):
        assert got.finished
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].text == want.outputs[0].text
    # Run one after another, 8 requests of 10 tokens would take at least 80 steps.
    assert after["num_steps"] - before["num_steps"] < 40
    assert after["max_batch_size"] >= 4
    assert engine_idle(engine)


def test_invalid_request_raises_with_its_param_and_the_engine_keeps_serving(engine):
    async def run():
        with pytest.raises(InvalidRequestError) as caught:
            await _last(engine, "bad", [10**6])
        assert caught.value.param == "prompt"
        with pytest.raises(InvalidRequestError) as caught:
            await _last(engine, "bad-stop", [5, 6], SamplingParams(stop_token_ids=[10**6]))
        assert caught.value.param == "stop_token_ids"
        return await _last(engine, "good", PROMPTS[0])

    assert len(asyncio.run(run()).outputs[0].token_ids) == GREEDY.max_tokens


def test_a_group_is_accepted_whole_or_not_at_all(engine):
    async def run():
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        with pytest.raises(InvalidRequestError):
            await engine.submit(
                [
                    GenerateRequest("g-ok", None, long, [5, 6, 7]),
                    GenerateRequest("g-bad", None, long, []),
                ]
            )

    asyncio.run(run())
    wait_for(lambda: engine_idle(engine), 10, "the valid half of a rejected group kept running")


def test_leaving_the_stream_early_aborts_and_frees_blocks(engine):
    params = SamplingParams(max_tokens=200, ignore_eos=True)

    async def run():
        outputs = engine.generate("early", None, params, PROMPTS[1] * 4)
        first = await anext(outputs)
        await outputs.aclose()
        return first

    first = asyncio.run(run())
    assert not first.finished
    wait_for(lambda: engine_idle(engine), 10, "an abandoned request kept its blocks")
    engine.engine.check_kv_integrity()


def test_cancelling_the_consumer_aborts(engine):
    params = SamplingParams(max_tokens=200, ignore_eos=True)

    async def run():
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate("cancelled", None, params, PROMPTS[2]):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    wait_for(lambda: engine_idle(engine), 10, "a cancelled request kept its blocks")
    engine.engine.check_kv_integrity()


def test_a_failing_step_errors_every_request_and_stops_the_engine(model_dir):
    engine = AsyncEngine.from_config(engine_config(model_dir))
    real_step = engine.engine.step
    calls = []

    def failing_step():
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("device lost")
        return real_step()

    engine.engine.step = failing_step
    params = SamplingParams(max_tokens=100, ignore_eos=True)

    async def run():
        results = await asyncio.gather(
            *(_last(engine, f"doomed-{i}", p, params) for i, p in enumerate(PROMPTS[:3])),
            return_exceptions=True,
        )
        assert all(isinstance(r, EngineDeadError) for r in results), results
        with pytest.raises(EngineDeadError):
            await _last(engine, "after", PROMPTS[0])

    asyncio.run(run())
    assert not engine.is_running
    assert "device lost" in str(engine.error)
    engine.shutdown()


def test_shutdown_ends_requests_in_flight_with_an_error(model_dir):
    engine = AsyncEngine.from_config(engine_config(model_dir))
    params = SamplingParams(max_tokens=240, ignore_eos=True)

    async def run():
        outputs = engine.generate("in-flight", None, params, PROMPTS[3])
        await anext(outputs)
        engine.shutdown()
        with pytest.raises(EngineDeadError):
            async for _ in outputs:
                pass

    asyncio.run(run())
    assert not engine.is_running and engine.error is None
    assert not engine._thread.is_alive()


def test_engine_is_built_and_stepped_on_its_own_thread(model_dir):
    """One thread loads and steps the model, so torch keeps a single OpenMP pool."""
    seen: dict[str, set[str]] = {"build": set(), "step": set()}

    def make() -> LLMEngine:
        seen["build"].add(threading.current_thread().name)
        engine = LLMEngine(engine_config(model_dir))
        step = engine.step

        def recorded_step():
            seen["step"].add(threading.current_thread().name)
            return step()

        engine.step = recorded_step
        return engine

    engine = AsyncEngine(make)
    try:
        assert asyncio.run(_last(engine, "thread-check", PROMPTS[0])).finished
    finally:
        engine.shutdown()
    assert seen["build"] == seen["step"] == {"platform-core-engine"}


def test_a_failure_to_build_the_engine_is_raised_by_the_constructor():
    def make() -> LLMEngine:
        raise ConfigError("no such model here")

    with pytest.raises(ConfigError, match="no such model here"):
        AsyncEngine(make)
