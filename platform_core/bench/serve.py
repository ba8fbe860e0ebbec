"""Async load generator for any OpenAI-compatible server (streaming ``/v1/completions``).

Requests leave at Poisson arrival times (``request_rate`` per second; ``inf`` sends all at once),
at most ``max_concurrency`` in flight. Each streams server-sent events; the client stamps every
chunk that carries a token: the first gives TTFT, the gaps give ITL. Output tokens are counted from
the ``usage`` of the final chunk (``stream_options.include_usage``), or, when a server sends no
usage, as the number of token-carrying chunks. Prompts go out as token-id lists when known
(OpenAI completions accept a list of ints as ``prompt``), else as text.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from platform_core.bench.metrics import RequestRecord
from platform_core.bench.workloads import BenchRequest


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """Where to send requests and how fast."""

    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = True
    api_key: str | None = None
    timeout_s: float = 600.0

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/" + self.endpoint.lstrip("/")

    @property
    def headers(self) -> dict[str, str]:
        """The bearer token, when there is an API key."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def arrival_offsets(num: int, rate: float, seed: int = 0) -> list[float]:
    """Send times (seconds from start) of a Poisson process of ``rate``; all 0 when infinite."""
    if math.isinf(rate):
        return [0.0] * num
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(num):
        now += rng.expovariate(rate)
        offsets.append(now)
    return offsets


def build_payload(config: ServeConfig, request: BenchRequest) -> dict[str, Any]:
    """The JSON body of one streaming completion request."""
    payload: dict[str, Any] = {
        "model": config.model,
        "prompt": request.prompt_token_ids
        if request.prompt_token_ids is not None
        else request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        payload["ignore_eos"] = True  # an extension most open servers accept
    return payload


def _carries_token(choices: list[dict[str, Any]]) -> bool:
    # A closing chunk (finish_reason set, no text) carries no token; a mid-stream chunk does, even
    # when its text is empty because the bytes decode only with the next token.
    return any(c.get("text") or c.get("finish_reason") is None for c in choices)


async def send_request(
    client: httpx.AsyncClient, config: ServeConfig, request: BenchRequest
) -> RequestRecord:
    """Send one request and time its stream; failures become records with an error."""
    start = time.perf_counter()
    ttft: float | None = None
    last = start
    itl: list[float] = []
    chunks = 0
    usage: dict[str, Any] | None = None
    try:
        async with client.stream(
            "POST", config.url, json=build_payload(config, request), headers=config.headers
        ) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                return RequestRecord(False, error=f"HTTP {response.status_code}: {body[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    return RequestRecord(False, error=f"stream error: {chunk['error']}")
                usage = chunk.get("usage") or usage
                if _carries_token(chunk.get("choices") or []):
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - start
                    else:
                        itl.append(now - last)
                    last = now
                    chunks += 1
        latency = time.perf_counter() - start
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return RequestRecord(False, error=f"{type(exc).__name__}: {exc}")
    if ttft is None:
        return RequestRecord(False, error="the stream ended without a token")
    usage = usage or {}
    return RequestRecord(
        success=True,
        prompt_len=usage.get("prompt_tokens") or request.prompt_len or 0,
        output_len=usage.get("completion_tokens") or chunks,
        ttft=ttft,
        latency=latency,
        itl=itl,
    )


async def run_serve(
    config: ServeConfig, requests: list[BenchRequest]
) -> tuple[list[RequestRecord], float]:
    """Send every request on schedule; return the records (input order) and the duration."""
    offsets = arrival_offsets(len(requests), config.request_rate, config.seed)
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=config.max_concurrency)
    timeout = httpx.Timeout(config.timeout_s)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        start = time.perf_counter()

        async def one(offset: float, request: BenchRequest) -> RequestRecord:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            if limit is None:
                return await send_request(client, config, request)
            async with limit:
                return await send_request(client, config, request)

        records = await asyncio.gather(*(one(o, r) for o, r in zip(offsets, requests)))
        duration = time.perf_counter() - start
    return list(records), duration
