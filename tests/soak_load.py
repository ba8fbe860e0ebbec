"""The soak's load: seeded random requests of every kind a careless or hostile client sends.

Run as its own process (``python soak_load.py URL NUM_REQUESTS CONCURRENCY SEED MIX``) so the
load's own CPU work is not done under the server's GIL; prints a JSON tally of what the clients
saw. ``MIX`` is ``mixed`` (every kind below) or ``benign`` (the same load of well-formed requests
read to the end: the baseline the mixed load is compared with).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from collections import Counter
from dataclasses import dataclass, field

import httpx

# Bodies no client should send; each must get a 4xx error object (never a 5xx, never a hang).
HOSTILE_BODIES: list[bytes] = [
    b"{",
    b"[]",
    b'{"prompt": 5}',
    b'{"prompt": "x", "n": true}',
    b'{"prompt": "x", "stream": "yes"}',
    b'{"prompt": "x", "max_tokens": 2.0}',
    b'{"prompt": "x", "max_tokens": -1}',
    b'{"prompt": "x", "n": 100000}',
    b'{"prompt": "x", "logit_bias": {"\\uff11\\uff12": 1}}',
    b'{"prompt": "x", "temperature": "hot"}',
    b'{"prompt": "", "max_tokens": 2}',
    b'{"prompt": [], "max_tokens": 2}',
    b'{"prompt": [999999999], "max_tokens": 2}',
    b'{"prompt": "x", "model": "not-served"}',
    b'{"prompt": "x", "stop": [""]}',
    b'{"prompt": "x", "timeout": -1}',
    json.dumps({"prompt": "x", "allowed_token_ids": list(range(300_000))}).encode(),
    json.dumps({"prompt": ["x"] * 20_000, "max_tokens": 1}).encode(),
]
# Bodies that are odd but valid JSON: each gets a 200 or a 4xx error object, never a 5xx.
ODD_BODIES: list[bytes] = [
    b'{"prompt": "\\ud800", "max_tokens": 2}',
    b'{"prompt": "a\\u0000b", "max_tokens": 2}',
    b'{"prompt": "\\uffff\\ufdd0", "max_tokens": 2}',
    b'{"prompt": "x", "stop": ["\\udfff"], "max_tokens": 2}',
    b'{"prompt": "x", "seed": 9223372036854775807, "n": 4, "max_tokens": 2}',
]
PROMPTS = ["Soak", "A paged cache", "Tell me"]


@dataclass
class Tally:
    """Status codes seen per kind of client (0: the client left before any status)."""

    statuses: dict[str, Counter] = field(default_factory=dict)
    bad_error_bodies: list[str] = field(default_factory=list)
    cut: Counter = field(default_factory=Counter)  # kind -> streams broken after their status

    def record(self, kind: str, status: int) -> None:
        self.statuses.setdefault(kind, Counter())[status] += 1


async def hostile(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    body = rng.choice(HOSTILE_BODIES + ODD_BODIES)
    headers = {"content-type": "application/json"}
    response = await client.post("/v1/completions", content=body, headers=headers)
    tally.record("hostile", response.status_code)
    if response.status_code >= 400:
        try:
            error = response.json().get("error")
        except ValueError:
            error = None
        if not (isinstance(error, dict) and error.get("message")):
            tally.bad_error_bodies.append(f"{response.status_code} {response.text[:200]}")


async def stream(
    client: httpx.AsyncClient,
    body: dict,
    kind: str,
    tally: Tally,
    answered: asyncio.Event,
    leave_after: int | None = None,
    pause: float = 0.0,
) -> None:
    """Stream ``body``; leave after ``leave_after`` events, or stop reading ``pause`` s after the
    first (a slow or stalled reader). ``answered`` is set once the status is tallied."""
    async with client.stream("POST", "/v1/completions", json=body) as response:
        tally.record(kind, response.status_code)
        answered.set()
        events = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            events += 1
            if leave_after is not None and events >= leave_after:
                return
            if pause and events == 1:
                await asyncio.sleep(pause)


MIXES = {  # mix -> (kind, cumulative share of the jobs)
    "mixed": [
        ("hostile", 0.20),
        ("whole", 0.55),
        ("disconnect", 0.70),
        ("cancel", 0.80),
        ("slow", 0.90),
        ("stalled", 0.95),
        ("stream", 1.00),
    ],
    "benign": [("whole", 0.45), ("stream", 1.00)],
}
DROPPED = -1  # the connection broke before any status came


async def job(client: httpx.AsyncClient, rng: random.Random, tally: Tally, mix: str) -> None:
    """One request of a seeded random kind; it is tallied once, by its status."""
    roll = rng.random()
    kind = next(name for name, share in MIXES[mix] if roll < share)
    base = {"prompt": rng.choice(PROMPTS), "seed": rng.randrange(1 << 30)}
    streamed = {
        **base,
        "max_tokens": rng.randint(8, 48),
        "ignore_eos": True,
        "stream": True,
        "n": rng.choice([1, 2]),
    }
    answered = asyncio.Event()
    try:
        if kind == "hostile":
            await hostile(client, rng, tally)
        elif kind == "whole":
            body = {**base, "max_tokens": rng.randint(1, 8), "n": rng.choice([1, 1, 2])}
            tally.record(kind, (await client.post("/v1/completions", json=body)).status_code)
        elif kind == "disconnect":
            leave_after = rng.randint(1, 4)
            await stream(client, streamed, kind, tally, answered, leave_after=leave_after)
        elif kind == "cancel":
            leave_at = rng.uniform(0, 0.3)
            try:
                await asyncio.wait_for(stream(client, streamed, kind, tally, answered), leave_at)
            except TimeoutError:
                if not answered.is_set():  # gone before the status line came
                    tally.record(kind, 0)
        else:
            pause = {"slow": 0.02, "stalled": 1.0}.get(kind, 0.0)
            await stream(client, streamed, kind, tally, answered, pause=pause)
    except httpx.TransportError:
        if answered.is_set():
            tally.cut[kind] += 1
        else:
            tally.record(kind, DROPPED)


async def run(base_url: str, num_requests: int, concurrency: int, seed: int, mix: str) -> Tally:
    """Send ``num_requests`` jobs over ``concurrency`` connections."""
    rng = random.Random(seed)
    tally = Tally()
    jobs = iter(range(num_requests))
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=120) as client:

        async def worker() -> None:
            for _ in jobs:
                await job(client, rng, tally, mix)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return tally


def main() -> None:
    url, (num_requests, concurrency, seed), mix = sys.argv[1], map(int, sys.argv[2:5]), sys.argv[5]
    tally = asyncio.run(run(url, num_requests, concurrency, seed, mix))
    figures = {
        "statuses": tally.statuses,
        "cut": tally.cut,
        "bad_error_bodies": tally.bad_error_bodies,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
