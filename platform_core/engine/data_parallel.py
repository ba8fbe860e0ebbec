"""Data parallelism: several engine replicas behind one front, each request routed to one.

Routing is least-loaded. A replica's load is the larger of the requests in flight counted at
this front (it reacts before the replica's stats refresh) and the replica's own running plus
waiting count from its latest stats (which include the requests of other fronts: with
``--api-server-count N`` every API server routes over the same engine cores). With prefix
affinity on, requests whose prompts start alike go to the same replica, where their prefix is
cached, unless that replica is clearly busier than the least-loaded one. Replicas are any
``SubmitFront`` (``AsyncEngine`` threads or ``ProcessEngine`` processes), and the router offers
the same surface, so the server takes either.
"""

from __future__ import annotations

import dataclasses
import hashlib
from array import array
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from typing import Any

from platform_core.config import EngineConfig
from platform_core.engine.outputs import RequestOutput
from platform_core.engine.request_stream import GenerateRequest, RequestStream, SubmitFront
from platform_core.errors import EngineDeadError

AFFINITY_TOKENS = 64  # the prompt prefix that decides a replica under prefix affinity
AFFINITY_SLACK = 4  # how many more requests the preferred replica may hold than the idlest


class _RoutedStream:
    """A replica's stream that tells the front when the group is done."""

    def __init__(self, inner: RequestStream, on_done: Any) -> None:
        self.request_ids = inner.request_ids
        self._inner = inner
        self._on_done = on_done

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[RequestOutput]:
        try:
            async with aclosing(aiter(self._inner)) as outputs:
                async for output in outputs:
                    yield output
        finally:
            self._on_done()


class DataParallelEngine(SubmitFront):
    """``len(replicas)`` engine fronts of the same model behind one interface."""

    def __init__(self, replicas: list[SubmitFront], prefix_affinity: bool = False) -> None:
        if not replicas:
            raise ValueError("at least one replica is needed")
        self.replicas = replicas
        self.prefix_affinity = prefix_affinity
        first = replicas[0]
        self.tokenizer = first.tokenizer
        self.max_model_len = min(r.max_model_len for r in replicas)
        self.eos_token_ids = first.eos_token_ids
        self.vocab_size = first.vocab_size
        self.default_sampling = first.default_sampling
        self.in_flight = [0] * len(replicas)
        self.routed = [0] * len(replicas)
        self._owner: dict[str, int] = {}

    @classmethod
    def from_config(
        cls, config: EngineConfig, start_replica: Callable[[EngineConfig], SubmitFront]
    ) -> DataParallelEngine:
        """Start ``config.parallel.data_parallel_size`` replicas (each with one DP rank) with
        ``start_replica``, all at once; if one fails, the others are shut down."""
        parallel = config.parallel
        single = dataclasses.replace(
            config, parallel=dataclasses.replace(parallel, data_parallel_size=1)
        )
        with ThreadPoolExecutor(parallel.data_parallel_size) as pool:
            starts = [
                pool.submit(start_replica, single) for _ in range(parallel.data_parallel_size)
            ]
        failures = [s.exception() for s in starts if s.exception() is not None]
        if failures:
            for start in starts:
                if start.exception() is None:
                    start.result().shutdown()
            raise failures[0]
        replicas = [s.result() for s in starts]
        return cls(replicas, prefix_affinity=parallel.data_parallel_routing == "prefix")

    @property
    def is_running(self) -> bool:
        return all(r.is_running for r in self.replicas)

    @property
    def error(self) -> EngineDeadError | None:
        return next((r.error for r in self.replicas if r.error), None)

    def stats(self) -> dict[str, Any]:
        """Counters summed over replicas, plus each replica's own under ``"replicas"``."""
        per_replica = [r.stats() for r in self.replicas]
        total: dict[str, Any] = {}
        for stats in per_replica:
            for key, value in stats.items():
                if isinstance(value, (int, float)):
                    total[key] = total.get(key, 0) + value
        if per_replica and "spec_acceptance_rate" in total:
            proposed = total.get("spec_proposed_tokens", 0)
            total["spec_acceptance_rate"] = total.get("spec_accepted_tokens", 0) / max(1, proposed)
        total["replicas"] = per_replica
        total["routed_requests"] = list(self.routed)
        return total

    def choose(self, requests: list[GenerateRequest]) -> int:
        """The replica for a submission (least loaded, or by prefix affinity)."""
        load = [self._load(i) for i in range(len(self.replicas))]
        idlest = min(range(len(self.replicas)), key=load.__getitem__)
        if not self.prefix_affinity:
            return idlest
        preferred = self._affinity(requests[0])
        if load[preferred] <= load[idlest] + AFFINITY_SLACK:
            return preferred
        return idlest

    def _load(self, index: int) -> int:
        stats = self.replicas[index].stats()
        seen = stats.get("num_running", 0) + stats.get("num_waiting", 0)
        return max(self.in_flight[index], seen)

    def _affinity(self, request: GenerateRequest) -> int:
        if request.prompt_token_ids is not None:
            key = array("q", request.prompt_token_ids[:AFFINITY_TOKENS]).tobytes()
        else:
            key = (request.prompt or "")[: AFFINITY_TOKENS * 4].encode()
        return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") % len(self.replicas)

    async def submit(
        self, requests: list[GenerateRequest], *, max_buffered_tokens: int | None = None
    ) -> _RoutedStream:
        """Route the submission to one replica and stream its outputs (the replica applies the
        deadline and ``max_buffered_tokens``, see ``SubmitFront.submit``)."""
        index = self.choose(requests)
        ids = [r.request_id for r in requests]
        # Count the submission before waiting for acceptance, so concurrent submits see it.
        self.in_flight[index] += 1
        for request_id in ids:
            self._owner[request_id] = index

        def done() -> None:
            self.in_flight[index] -= 1
            for request_id in ids:
                self._owner.pop(request_id, None)

        try:
            stream = await self.replicas[index].submit(
                requests, max_buffered_tokens=max_buffered_tokens
            )
        except BaseException:
            done()
            raise
        self.routed[index] += len(ids)
        return _RoutedStream(stream, done)

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            index = self._owner.get(request_id)
            if index is not None:
                self.replicas[index].abort([request_id])

    def shutdown(self, timeout: float | None = 30.0) -> None:
        for replica in self.replicas:
            replica.shutdown(timeout)
