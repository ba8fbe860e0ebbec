"""Many clients at once: batched into shared steps, independent results, disconnects freeing KV."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from server_utils import MODEL_NAME, assert_engine_clean, engine_config, engine_idle, wait_for

from platform_core import LLM, SamplingParams

NUM_CLIENTS = 32
MAX_TOKENS = 12


def _client_params(i: int) -> dict:
    """Even clients decode greedily, odd ones sample with their own seed."""
    if i % 2 == 0:
        return {"temperature": 0.0}
    return {"temperature": 1.0, "seed": 1000 + i}


def test_concurrent_streams_are_batched_and_independent(base_url, engine, model_dir):
    words = ["capital", "fox", "paged", "batching", "Rome", "memory", "again", "Köln"]
    prompts = [f"{words[i % 8]} {i} {words[(i * 3) % 8]}" for i in range(NUM_CLIENTS)]
    before = engine.stats()

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        text, finish = "", None
        stream = await client.completions.create(
            model=MODEL_NAME,
            prompt=prompts[i],
            max_tokens=MAX_TOKENS,
            stream=True,
            extra_body={"ignore_eos": True},
            **_client_params(i),
        )
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def run():
        client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(NUM_CLIENTS)))

    results = asyncio.run(run())
    after = engine.stats()
    llm = LLM(config=engine_config(model_dir))
    expected = llm.generate(
        prompts,
        [
            SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **_client_params(i))
            for i in range(NUM_CLIENTS)
        ],
        use_tqdm=False,
    )
    assert [r[0] for r in results] == [e.outputs[0].text for e in expected]
    assert all(r[1] == "length" for r in results)
    # One after another these would take NUM_CLIENTS * MAX_TOKENS = 384 steps.
    steps = after["num_steps"] - before["num_steps"]
    assert steps < NUM_CLIENTS * MAX_TOKENS / 4, steps
    assert after["max_batch_size"] >= NUM_CLIENTS // 2
    wait_for(lambda: engine_idle(engine), 10, "blocks were not freed after the clients finished")


@pytest.fixture
def slow_engine(steps):
    """Steps take at least 10 ms (so a request lasts); the probe records aborts."""
    steps.delay = 0.01
    return steps


def test_a_client_leaving_mid_stream_aborts_and_frees_blocks(base_url, engine, slow_engine):
    body = {"prompt": "The capital of", "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base_url + "/v1/completions", json=body) as response:
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 2:
                break
        assert engine.stats()["kv_blocks_used"] > 0
    wait_for(lambda: engine_idle(engine), 10, "the abandoned stream kept its KV blocks")
    assert [r for r in slow_engine.aborted() if r.startswith("cmpl-")], "it was not aborted"
    assert_engine_clean(engine, slow_engine)


def test_a_client_leaving_before_a_whole_response_aborts_it(base_url, engine, slow_engine):
    body = {"prompt": "The capital of", "max_tokens": 240, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base_url + "/v1/completions", json=body, timeout=0.5)
    wait_for(lambda: engine_idle(engine), 10, "the abandoned request kept its KV blocks")
    assert [r for r in slow_engine.aborted() if r.startswith("cmpl-")], "it was not aborted"
    assert_engine_clean(engine, slow_engine)
    ok = httpx.post(base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 3})
    assert ok.status_code == 200
