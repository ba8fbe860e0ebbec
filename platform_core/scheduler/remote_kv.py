"""The scheduler's side of a KV connector: requests loading remote blocks, blocks held for peers.

Block ownership stays with the KV-cache manager, under the request's id, in both cases:

- **Loading** (consumer): a waiting request whose prompt a remote instance holds gets blocks for
  its locally cached prefix plus the remote part (every prompt token but the last, whose logits
  are needed: the last block may be partial) and waits in ``loading``: it is neither running nor
  waiting, so it holds up nobody. When the worker reports the load finished, the blocks up to
  the first failed one count as computed (and join the prefix cache); the rest are freed and
  recomputed. A request aborted while loading keeps its blocks until the load ends (the worker
  may be writing them), then frees them.
- **Held** (producer): a finished request whose connector keeps its blocks for a peer stays in
  ``held`` until the worker reports the peer has them or ``hold_timeout_s`` passes.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from platform_core.kv_cache.manager import KVCacheManager
from platform_core.kv_transfer.interfaces import (
    KVConnectorOutput,
    KVConnectorScheduler,
    TransferStats,
)
from platform_core.scheduler.request import Request, RequestStatus

LATENCY_WINDOW = 1024  # loads kept for the latency percentiles


@dataclass(slots=True)
class RemoteKVStats:
    """Counters since the engine started: loads (consumer), holds (producer) and the workers'
    transfer counters."""

    num_loads: int = 0
    num_loaded_tokens: int = 0
    num_recomputed_tokens: int = 0  # remote tokens that failed to load and were recomputed
    num_holds: int = 0
    num_hold_timeouts: int = 0
    transfer: TransferStats = field(default_factory=TransferStats)  # latencies left empty
    # the latest loads' durations, and their percentiles (kept current: stats are read per step)
    latencies_s: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    latency_p50_s: float = 0.0
    latency_p99_s: float = 0.0

    def add_latencies(self, seconds: list[float]) -> None:
        """Record finished loads' durations and update the percentiles."""
        self.latencies_s.extend(seconds)
        ordered = sorted(self.latencies_s)
        self.latency_p50_s = _percentile(ordered, 0.50)
        self.latency_p99_s = _percentile(ordered, 0.99)

    def as_dict(self, num_loading: int, num_held: int) -> dict[str, float | int]:
        """Flat ``kv_transfer_*`` counters for the engine's stats."""
        t = self.transfer
        return {
            "kv_transfer_loading": num_loading,
            "kv_transfer_held": num_held,
            "kv_transfer_loads": self.num_loads,
            "kv_transfer_loaded_tokens": self.num_loaded_tokens,
            "kv_transfer_recomputed_tokens": self.num_recomputed_tokens,
            "kv_transfer_holds": self.num_holds,
            "kv_transfer_hold_timeouts": self.num_hold_timeouts,
            "kv_transfer_bytes_received": t.bytes_received,
            "kv_transfer_bytes_sent": t.bytes_sent,
            "kv_transfer_blocks_received": t.blocks_received,
            "kv_transfer_blocks_sent": t.blocks_sent,
            "kv_transfer_failed_blocks": t.failed_blocks,
            "kv_transfer_failed_transfers": t.failed_transfers,
            "kv_transfer_latency_p50_s": self.latency_p50_s,
            "kv_transfer_latency_p99_s": self.latency_p99_s,
        }


def _percentile(ordered: list[float], q: float) -> float:
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class RemoteKV:
    """Tracks loading and held requests for the scheduler (see the module docstring)."""

    def __init__(self, connector: KVConnectorScheduler, kv: KVCacheManager, hold_timeout_s: float):
        self.connector = connector
        self.kv = kv
        self.hold_timeout_s = hold_timeout_s
        self.loading: dict[str, Request] = {}
        # request id -> when its hold expires (time.monotonic()); insertion order is expiry order
        self.held: dict[str, float] = {}
        self.abandoned: set[str] = set()  # aborted while loading: freed when the load ends
        self.stats = RemoteKVStats()

    @property
    def num_loading(self) -> int:
        return len(self.loading)

    @property
    def pending(self) -> bool:
        return bool(self.loading or self.held or self.abandoned)

    def holds_blocks_of(self, request_id: str) -> bool:
        """Whether blocks are still kept under ``request_id`` after it finished."""
        return request_id in self.held or request_id in self.abandoned

    def metadata(self) -> Any:
        """The connector's instructions for this step's worker side."""
        return self.connector.build_metadata()

    def start_load(self, request: Request, cached: list[int]) -> bool | None:
        """Ask the connector about ``request`` (first admission only) and, when a remote
        instance holds more of its prompt than ``cached``, allocate blocks and park it in
        ``loading``. True: parked; False: nothing to load; None: no room yet (ask again)."""
        request.kv_load_checked = True
        block_size = self.kv.block_size
        num_local = len(cached) * block_size
        remote = self.connector.remote_tokens(request, num_local)
        loadable = request.num_prompt_tokens - 1  # the last token is computed here: its logits
        if request.sampling_params.prompt_logprobs is not None:
            loadable = 0  # every prompt position's logits are needed: the prompt is computed
        num_tokens = min(remote.num_tokens, loadable - num_local)
        if num_tokens <= 0:
            if remote.num_tokens > 0:
                self.connector.release(request.request_id, "unused")
            return False
        if not self.kv.allocate_slots(request, num_tokens, cached):
            request.kv_load_checked = False
            return None
        blocks = self.kv.block_ids(request.request_id)
        first = len(cached)
        self.connector.blocks_allocated(
            request, blocks[first : first + self.kv.blocks_needed(num_tokens)], first
        )
        request.num_computed_tokens = num_local
        request.num_loading_tokens = num_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.loading[request.request_id] = request
        self.stats.num_loads += 1
        return True

    def abandon(self, request: Request) -> None:
        """``request`` is aborted while loading: free its blocks once the load ends."""
        del self.loading[request.request_id]
        self.abandoned.add(request.request_id)
        self.connector.release(request.request_id, "aborted")

    def keep_blocks(self, request: Request, finished_normally: bool) -> bool:
        """Whether a finishing request's blocks stay (held for a peer); sets what its output
        tells the client (``kv_transfer_result``)."""
        if not finished_normally:
            return False
        blocks = self.kv.block_ids(request.request_id)
        result = self.connector.request_finished(request, blocks, request.num_computed_tokens)
        request.kv_transfer_result = result.params
        if not (result.hold and blocks):
            return False
        self.held[request.request_id] = time.monotonic() + self.hold_timeout_s
        self.stats.num_holds += 1
        return True

    def expire_holds(self) -> None:
        """Free the blocks of holds whose peer never came."""
        if not self.held:
            return
        now = time.monotonic()
        for request_id, deadline in list(self.held.items()):
            if deadline > now:
                break
            del self.held[request_id]
            self.connector.release(request_id, "timeout")
            self.kv.free(request_id)
            self.stats.num_hold_timeouts += 1

    def update(self, output: KVConnectorOutput) -> list[Request]:
        """Apply the worker's report; the loaded requests, ready to be scheduled (in order)."""
        if output.stats.latencies_s:
            self.stats.add_latencies(output.stats.latencies_s)
            output.stats.latencies_s = []
        self.stats.transfer.add(output.stats)
        for request_id in output.finished_sending:
            if self.held.pop(request_id, None) is not None:
                self.kv.free(request_id)
        ready = []
        for request_id in output.finished_recving:
            if request_id in self.abandoned:
                self.abandoned.discard(request_id)
                self.kv.free(request_id)
                continue
            request = self.loading.pop(request_id, None)
            if request is not None:
                self._land(request, set(output.failed_blocks.get(request_id, ())))
                ready.append(request)
        return ready

    def _land(self, request: Request, failed: set[int]) -> None:
        """Count the loaded blocks up to the first failed one as computed; free the rest."""
        block_size = self.kv.block_size
        first = request.num_computed_tokens // block_size
        expected = self.kv.block_ids(request.request_id)[
            first : first + self.kv.blocks_needed(request.num_loading_tokens)
        ]
        intact = 0
        for block_id in expected:
            if block_id in failed:
                break
            intact += 1
        loaded = min(intact * block_size, request.num_loading_tokens)  # the last may be partial
        request.num_computed_tokens += loaded
        self.stats.num_loaded_tokens += loaded
        self.stats.num_recomputed_tokens += request.num_loading_tokens - loaded
        request.num_loading_tokens = 0
        self.kv.trim(request)
        self.kv.cache_computed_blocks(request)
        request.num_cached_tokens = max(request.num_cached_tokens, request.num_computed_tokens)
        request.status = RequestStatus.WAITING
