"""Helpers for the KV-transfer tests: a producer/consumer pair of engines in one process."""

from __future__ import annotations

import itertools
import time
from typing import Any

from platform_core import LLM, SamplingParams
from platform_core.engine.outputs import RequestOutput

_ENGINE_IDS = itertools.count()
COMMON = {"dtype": "float32", "kv_cache_memory_bytes": 1 << 22, "block_size": 16}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def prompt_of(length: int, start: int = 3) -> list[int]:
    """A deterministic prompt of ``length`` token ids (different ``start``: another prompt)."""
    return [(start + 7 * i) % 250 + 3 for i in range(length)]


def connector_llm(
    model_dir: Any, role: str, connector: str = "loopback", backend: str = "cpu", **kwargs: Any
) -> LLM:
    """An ``LLM`` with a KV connector in ``role``, under a fresh engine id."""
    transfer = {
        "kv_connector": connector,
        "kv_role": role,
        "engine_id": f"{role}-{next(_ENGINE_IDS)}",
        **kwargs.pop("transfer", {}),
    }
    return LLM(str(model_dir), backend=backend, kv_transfer_config=transfer, **{**COMMON, **kwargs})


def run(engine: Any, request_id: str, prompt: list[int], params: SamplingParams, **kw: Any):
    """Add one request and step until it finishes; its final output."""
    engine.add_request(request_id, None, params, prompt_token_ids=prompt, **kw)
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                final = output
    return final


def prefill(producer: LLM, request_id: str, prompt: list[int]) -> dict[str, Any]:
    """Run ``prompt`` on the producer for its KV; the parameters a consumer needs. One more
    step registers the hold with the producer's worker side (a server's loop does it at once)."""
    engine = producer.engine
    params = SamplingParams(temperature=0.0, max_tokens=1)
    output = run(engine, request_id, prompt, params, kv_transfer_params={"do_remote_decode": True})
    engine.step()
    return output.kv_transfer_params


def decode(
    consumer: LLM, request_id: str, prompt: list[int], params: SamplingParams, kv_params: Any
) -> RequestOutput:
    """Generate on the consumer with the producer's parameters."""
    return run(consumer.engine, request_id, prompt, params, kv_transfer_params=kv_params)


def settle(llm: LLM, timeout_s: float = 10.0) -> None:
    """Step until the engine has no held blocks or loads left (bounded), then check integrity:
    every block back in the free pool."""
    engine = llm.engine
    deadline = time.monotonic() + timeout_s
    while engine.has_pending_kv_transfers() and time.monotonic() < deadline:
        engine.step()
    assert not engine.has_pending_kv_transfers(), "KV transfers still pending"
    engine.check_kv_integrity()
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0, f"{stats['kv_blocks_used']} blocks leaked"


def tokens(output: RequestOutput) -> list[list[int]]:
    return [list(c.token_ids) for c in output.outputs]
