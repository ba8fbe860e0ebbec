"""A soak over loopback: 5,000 mixed requests (well-formed, disconnecting, cancelled, slow and
stalled readers, hostile bodies; ``soak_load.py``, in its own process) while one well-behaved
client streams beside them.

Asserted: no 5xx, every 4xx an OpenAI error object, no connection broken by the server, no KV
block leaked, the server's resident memory bounded, and the well-behaved client's time per output
token (p99) beside the mixed load within 2x of its value beside a benign load of the same size
(well-formed requests read to the end, from the same load process). Its value with the server to
itself is printed too, but on one small machine it is not the baseline: the load process takes a
core and the engine batches the load's requests with the steady one, which a hostile client
does not cause. The figures are printed (``-s``) and recorded in RELIABILITY.md.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_utils import assert_engine_clean, engine_config, live_server, start_test_engine

NUM_REQUESTS = 5000
NUM_BENIGN = NUM_REQUESTS  # as many runs of the steady client beside each load
LOAD_CONCURRENCY = 24
STEADY_TOKENS = 24
STEADY_ALONE_RUNS = 12
RSS_GROWTH_LIMIT_MIB = 300
LOAD_KEYS = {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "kv_cache_memory_bytes": 1 << 23}
LOAD_SCRIPT = Path(__file__).with_name("soak_load.py")


def rss_mib() -> float:
    """This process's resident memory (the server runs in it), in MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


async def steady_tpot(client: httpx.AsyncClient, seed: int) -> float:
    """Stream one request and return its mean seconds per output token after the first chunk
    (a chunk may carry several tokens when the server falls behind; logprobs count them). A
    stream that arrives in one chunk has no such span: its whole wait from the request, per
    token, is charged instead (a stall counts against the server rather than being dropped)."""
    body = {
        "prompt": "The steady client",
        "max_tokens": STEADY_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 1,
        "seed": seed,
    }
    first: tuple[float, int] | None = None
    last, tokens = 0.0, 0
    sent = time.monotonic()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[len("data: ") :])["choices"]
            tokens += sum(len(c["logprobs"]["tokens"]) for c in choices if c["logprobs"])
            last = time.monotonic()
            first = first or (last, tokens)
    assert tokens == STEADY_TOKENS, "the steady client's stream came back short"
    assert first is not None
    if tokens == first[1]:  # the whole answer in one chunk
        return (last - sent) / tokens
    return (last - first[0]) / (tokens - first[1])


async def beside_load(
    client: httpx.AsyncClient, base_url: str, mix: str, num_requests: int, seed: int
) -> tuple[list[float], dict, float]:
    """Run ``soak_load.py`` with ``mix``; the steady client streams until it ends.

    Returns the steady client's TPOTs, the load's tally and the load's wall time.
    """
    started = time.monotonic()
    load = await asyncio.create_subprocess_exec(
        sys.executable,
        str(LOAD_SCRIPT),
        base_url,
        str(num_requests),
        str(LOAD_CONCURRENCY),
        "0",
        mix,
        stdout=asyncio.subprocess.PIPE,
    )
    finished = asyncio.ensure_future(load.communicate())
    tpots = []
    while not finished.done():
        tpots.append(await steady_tpot(client, seed + len(tpots)))
    stdout, _ = await asyncio.wait_for(finished, timeout=900)
    assert load.returncode == 0, f"the {mix} load process failed"
    return tpots, json.loads(stdout), time.monotonic() - started


async def soak(base_url: str) -> dict:
    """The steady client alone, beside a benign load, then beside the mixed one."""
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        alone = [await steady_tpot(client, i) for i in range(STEADY_ALONE_RUNS)]
        benign, benign_load, _ = await beside_load(client, base_url, "benign", NUM_BENIGN, 1000)
        rss_before = rss_mib()
        mixed, load, elapsed = await beside_load(client, base_url, "mixed", NUM_REQUESTS, 2000)
        return {
            "alone": alone,
            "benign": benign,
            "benign_load": benign_load,
            "mixed": mixed,
            "load": load,
            "elapsed_s": elapsed,
            "rss_growth_mib": rss_mib() - rss_before,
        }


@pytest.fixture(scope="module")
def engine(model_dir, probe):
    engine = start_test_engine(engine_config(model_dir, **LOAD_KEYS), probe)
    yield engine
    engine.shutdown()


def test_a_soak_of_mixed_and_hostile_requests_leaves_the_server_whole(engine, probe):
    with live_server(engine) as base_url:
        figures = asyncio.run(soak(base_url))
    statuses = figures["load"]["statuses"]
    assert sum(sum(c.values()) for c in statuses.values()) == NUM_REQUESTS
    server_errors = {k: s for k, c in statuses.items() for s in c if int(s) >= 500}
    assert not server_errors, f"5xx answers: {statuses}"
    assert not figures["load"]["bad_error_bodies"], "a 4xx without an OpenAI error object"
    dropped = {k: c["-1"] for k, c in statuses.items() if "-1" in c}
    assert not dropped and not figures["load"]["cut"], (
        f"connections broken by the server: {figures}"
    )
    assert set(statuses["whole"]) == {"200"}, f"a well-formed request was refused: {statuses}"
    assert_engine_clean(engine, probe)
    benign = figures["benign_load"]["statuses"]
    assert all(set(c) == {"200"} for c in benign.values()), f"benign load: {benign}"
    p99 = {
        k: statistics.quantiles(figures[k], n=100, method="inclusive")[98]
        for k in ("alone", "benign", "mixed")
    }
    print(
        f"\nsoak: {NUM_REQUESTS} requests in {figures['elapsed_s']:.1f} s {statuses}; "
        f"RSS growth {figures['rss_growth_mib']:.0f} MiB; 0 blocks leaked; steady TPOT p99: "
        f"alone {p99['alone'] * 1e3:.1f} ms, beside the benign load {p99['benign'] * 1e3:.1f} "
        f"ms ({len(figures['benign'])} runs), beside the mixed load {p99['mixed'] * 1e3:.1f} ms "
        f"({len(figures['mixed'])} runs)"
    )
    assert figures["rss_growth_mib"] < RSS_GROWTH_LIMIT_MIB
    assert p99["mixed"] <= 2 * p99["benign"], "hostile clients slowed the well-behaved one"
