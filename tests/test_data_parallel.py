"""Data parallelism: two engine replicas behind one server, least-loaded and prefix routing."""

from __future__ import annotations

import asyncio

import openai
import pytest
from server_utils import MODEL_NAME, engine_config, engine_idle, live_server, wait_for
from text_model import save_text_model

from platform_core import LLM, SamplingParams
from platform_core.engine.async_engine import AsyncEngine
from platform_core.engine.data_parallel import DataParallelEngine
from platform_core.engine.request_stream import GenerateRequest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_text_model(tmp_path_factory.mktemp("dp-model"))


@pytest.fixture(scope="module")
def replicas(model_dir):
    engines = [AsyncEngine.from_config(engine_config(model_dir)) for _ in range(2)]
    yield engines
    for engine in engines:
        engine.shutdown()


def prompts() -> list[str]:
    return [f"The capital of country number {i} is" for i in range(12)]


def test_two_replicas_serve_concurrent_requests(model_dir, replicas):
    front = DataParallelEngine(replicas)
    before = [r.stats()["num_scheduled_tokens"] for r in replicas]

    async def run(base_url: str) -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x")
        replies = await asyncio.gather(
            *(
                client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=8, temperature=0.0)
                for p in prompts()
            )
        )
        await client.close()
        return [r.choices[0].text for r in replies]

    with live_server(front) as url:
        texts = asyncio.run(run(url))
    assert min(front.routed) >= 3, f"one replica got almost nothing: {front.routed}"
    after = [r.stats()["num_scheduled_tokens"] for r in replicas]
    assert all(a > b for a, b in zip(after, before)), "both replicas must have run steps"
    llm = LLM(config=engine_config(model_dir))
    expected = llm.generate(
        prompts(), SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False
    )
    assert texts == [o.outputs[0].text for o in expected]
    assert front.stats()["kv_blocks_used"] == 0 and front.in_flight == [0, 0]


def test_prefix_affinity_keeps_a_prefix_on_one_replica(replicas):
    front = DataParallelEngine(replicas, prefix_affinity=True)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    # Two prefixes that map to different replicas.
    prefixes = {}
    for start in range(10, 200, 7):
        prefix = list(range(start, start + 70))
        replica = front._affinity(GenerateRequest("probe", None, params, prefix))
        prefixes.setdefault(replica, prefix)
    assert len(prefixes) == 2

    async def run() -> dict[str, int]:
        placed, streams = {}, []
        for replica, prefix in prefixes.items():
            for i in range(3):  # in flight together: within the affinity slack
                request_id = f"aff-{replica}-{i}"
                stream = await front.submit(
                    [GenerateRequest(request_id, None, params, prefix + [i])]
                )
                placed[request_id] = front._owner[request_id]
                streams.append(stream)
        for stream in streams:
            async for _ in stream:
                pass
        return placed

    placed = asyncio.run(run())
    for request_id, replica in placed.items():
        assert request_id.startswith(f"aff-{replica}-")
    hits = sum(r.stats()["prefix_cache_hit_tokens"] for r in replicas)
    assert hits > 0


def test_routing_counts_the_requests_other_fronts_sent_to_a_replica(replicas):
    """Another API server's requests show in the replica's stats; this front avoids it."""
    other, mine = DataParallelEngine(replicas), DataParallelEngine(replicas)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    probe = [GenerateRequest("probe", "hello", params)]

    async def run() -> int:
        ids = [f"other-{i}" for i in range(4)]
        streams = [
            await replicas[0].submit([GenerateRequest(rid, "The capital of", params)])
            for rid in ids
        ]
        deadline = asyncio.get_running_loop().time() + 60
        while replicas[0].stats()["num_running"] < 4:
            assert asyncio.get_running_loop().time() < deadline, replicas[0].stats()
            await asyncio.sleep(0.02)
        chosen = mine.choose(probe)
        # An abort from outside ends the requests without a last output: nothing more is read.
        replicas[0].abort(ids)
        del streams
        return chosen

    assert other.in_flight == mine.in_flight == [0, 0]
    assert asyncio.run(run()) == 1
    wait_for(lambda: engine_idle(replicas[0]), 30, f"aborted requests kept: {replicas[0].stats()}")
