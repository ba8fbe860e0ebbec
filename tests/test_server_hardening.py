"""The HTTP side of issue #27 (hostile load), over loopback: request limits, tokenizing off the
event loop, deadlines that cover acceptance and a clean drain at shutdown (hostile bodies:
``test_server_hostile_input.py``; connections: ``test_server_connections.py``)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from server_utils import (
    engine_idle,
    expect_error,
    live_server,
    wait_for,
)

from platform_core.entrypoints.openai.api_server import ServerSettings
from platform_core.entrypoints.openai.limits import RequestLimits
from platform_core.entrypoints.openai.prepare import Preparer

CHAT = [{"role": "user", "content": "hello"}]


# ------------------------------------------------------------------------------ 1. limits
def test_two_hundred_thousand_prompts_are_refused_before_queueing(base_url, engine):
    started = time.monotonic()
    response = httpx.post(
        base_url + "/v1/completions", json={"prompt": ["a"] * 200_000}, timeout=60
    )
    elapsed = time.monotonic() - started
    error = expect_error(response, 400, "prompt")
    assert "200000" in error["message"] and "1024" in error["message"]
    assert engine.stats()["num_waiting"] == 0
    assert elapsed < 10, f"refusing took {elapsed:.1f} s"
    print(f"\n200,000 prompts refused in {elapsed * 1000:.0f} ms")


def test_limits_on_choices_and_id_lists_name_the_field_and_bound(engine):
    limits = RequestLimits(max_prompts=4, max_choices=6, max_token_id_list=8)
    ids = list(range(3, 12))  # 9 ids, all in the vocabulary
    with live_server(engine, limits=limits) as url:
        cases = [
            ({"prompt": ["a"] * 5}, "prompt", "4"),
            ({"prompt": [[5, 6]] * 5}, "prompt", "4"),
            ({"prompt": ["a"] * 4, "n": 2}, "n", "6"),
            ({"prompt": "a", "allowed_token_ids": ids}, "allowed_token_ids", "8"),
            ({"prompt": "a", "stop_token_ids": ids}, "stop_token_ids", "8"),
            ({"prompt": "a", "logit_bias": {str(i): 1.0 for i in ids}}, "logit_bias", "8"),
        ]
        for body, param, bound in cases:
            response = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 1})
            assert bound in expect_error(response, 400, param)["message"], body
        chat = {"messages": CHAT, "n": 7, "max_tokens": 1}
        expect_error(httpx.post(url + "/v1/chat/completions", json=chat), 400, "n")
        within = {"prompt": ["a"] * 3, "n": 2, "max_tokens": 1, "stop_token_ids": ids[:8]}
        ok = httpx.post(url + "/v1/completions", json=within, timeout=60)
        assert ok.status_code == 200, ok.text
        assert len(ok.json()["choices"]) == 6


def test_a_huge_allowed_token_ids_list_is_refused(base_url):
    body = {"prompt": "a", "allowed_token_ids": [5] * 200_000}
    error = expect_error(httpx.post(base_url + "/v1/completions", json=body, timeout=60), 400)
    assert error["param"] == "allowed_token_ids" and "8192" in error["message"]


# ---------------------------------------------------------------- 2. tokenizing off the loop
# 3.8 MB of text (under the 4 MiB body limit) is tokenized on a worker thread; 3.9 MB of token
# ids is decoded on the event loop, the longest pause a body within the limit can cause.
BIG_BODIES = {
    "a 4 MB prompt": ({"prompt": "The capital of France is Paris. " * 120_000}, "prompt"),
    "half a million token ids": (
        {"prompt": "a", "allowed_token_ids": list(range(500_000))},
        "allowed_token_ids",
    ),
}


@pytest.mark.parametrize("what", BIG_BODIES)
def test_health_answers_while_a_big_body_is_prepared(base_url, what):
    body, param = BIG_BODIES[what]
    result: dict = {}

    def send() -> None:
        started = time.monotonic()
        result["response"] = httpx.post(
            base_url + "/v1/completions", json={**body, "max_tokens": 1}, timeout=120
        )
        result["elapsed"] = time.monotonic() - started

    sender = threading.Thread(target=send)
    latencies = []
    with httpx.Client(base_url=base_url, timeout=30) as client:
        sender.start()
        while sender.is_alive():
            started = time.monotonic()
            assert client.get("/health").status_code == 200
            latencies.append(time.monotonic() - started)
            time.sleep(0.02)
    sender.join()
    expect_error(result["response"], 400, param)
    assert len(latencies) >= 3, f"the request took only {result['elapsed']:.2f} s"
    print(
        f"\n{what} answered in {result['elapsed']:.2f} s; {len(latencies)} /health calls "
        f"meanwhile, max {max(latencies) * 1000:.0f} ms"
    )
    assert max(latencies) < 1.0


def test_the_fast_tokenizer_path_matches_the_tokenizer(engine):
    tokenizer = engine.tokenizer
    preparer = Preparer(tokenizer, engine.vocab_size, 1 << 20, threads=1)
    assert preparer._backend is not None  # the GIL-releasing path is the one under test
    texts = ["hi there", "", "NUL\x00 and U+FFFE \ufffe", "Grüße 🚀 東京", " lead space"]

    async def check() -> None:
        for text in texts:
            for special in (True, False):
                ids = await preparer.encode(text, special)
                assert ids == tokenizer.encode(text, add_special_tokens=special)
                assert await preparer.decode(ids) == tokenizer.decode(ids)

    import asyncio

    asyncio.run(check())
    preparer.shutdown()


# ---------------------------------------------------------- 3. deadline includes acceptance
def test_a_timeout_covers_waiting_for_the_engine_to_accept(base_url, engine, steps):
    steps.once = 4.0  # the next step stalls for 4 s (a long prefill)
    steps.entered.clear()
    blocker = threading.Thread(
        target=httpx.post,
        args=(base_url + "/v1/completions",),
        kwargs={"json": {"prompt": "x", "max_tokens": 2}, "timeout": 60},
    )
    blocker.start()
    assert steps.entered.wait(30)
    started = time.monotonic()
    late = {"prompt": "The capital of", "max_tokens": 5, "timeout": 0.5}
    response = httpx.post(base_url + "/v1/completions", json=late, timeout=30)
    elapsed = time.monotonic() - started
    assert expect_error(response, 408)["code"] == "deadline_exceeded"
    assert elapsed < 2.5, f"408 after {elapsed:.1f} s: the wait for acceptance was not covered"
    blocker.join(30)
    wait_for(lambda: engine_idle(engine), 30, f"a request leaked: {engine.stats()}")
    print(f"\n408 after {elapsed:.2f} s while the engine was in a 4 s step")


# ------------------------------------------------------------------- 4. shutdown drain
def test_requests_still_running_at_the_drain_deadline_end_cleanly(engine, steps):
    steps.delay = 0.05  # 200 tokens take 10 s, far beyond the 1 s drain
    body = {"prompt": "The capital of", "max_tokens": 200, "ignore_eos": True}
    results: dict = {}
    first_event = threading.Event()

    def whole(url: str) -> None:
        results["whole"] = httpx.post(url + "/v1/completions", json=body, timeout=60)

    def stream(url: str) -> None:
        events = results["events"] = []
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    first_event.set()

    settings = ServerSettings(log_level="warning", shutdown_timeout=1.0, exit_on_engine_death=False)
    with live_server(engine, settings=settings) as url:
        clients = [threading.Thread(target=f, args=(url,)) for f in (whole, stream)]
        for client in clients:
            client.start()
        assert first_event.wait(30)
        wait_for(lambda: engine.stats()["num_running"] >= 2, 30, "both requests were not running")
        started = time.monotonic()
    stopped = time.monotonic() - started  # leaving the block stops the server (drain: 1 s)
    for client in clients:
        client.join(30)
    error = expect_error(results["whole"], 503)
    assert error["code"] == "server_shutting_down"
    events = results["events"]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "server_shutting_down"
    assert stopped < 5, f"stopping took {stopped:.1f} s"
    wait_for(lambda: engine_idle(engine), 30, f"blocks leaked at shutdown: {engine.stats()}")
