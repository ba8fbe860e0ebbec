"""KV-cache waste: the share of allocated KV slots that hold no live token.

Sampled after every engine step. ``allocated`` is the number of distinct blocks held by running
requests times the block size (a prefix block shared by several requests counts once; blocks
cached for reuse but held by nobody are free, not allocated). ``live`` counts, for each of those
blocks, the slots holding a computed token (K/V written: ``num_computed_tokens``), the fullest
holder's view for shared blocks. ``waste = (allocated - live) / allocated``. Right after a step
this is the unfilled tail of each request's last block; steps with nothing allocated are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class KVSample:
    """Allocated slots and live tokens at one instant."""

    allocated_slots: int
    live_tokens: int

    @property
    def waste(self) -> float:
        return (self.allocated_slots - self.live_tokens) / self.allocated_slots


def sample_kv(scheduler: Any) -> KVSample:
    """Measure the scheduler's KV cache now (reads ``scheduler.running`` and ``scheduler.kv``)."""
    kv = scheduler.kv
    size = kv.block_size
    fill: dict[int, int] = {}
    for request in scheduler.running:
        computed = request.num_computed_tokens
        for index, block in enumerate(kv.block_ids(request.request_id)):
            used = min(size, max(0, computed - index * size))
            fill[block] = max(used, fill.get(block, 0))
    return KVSample(len(fill) * size, sum(fill.values()))


@dataclass(slots=True)
class KVWasteTracker:
    """Running mean and max of KV waste over the samples taken."""

    num_samples: int = 0
    total: float = 0.0
    max: float = 0.0

    def record(self, scheduler: Any) -> None:
        sample = sample_kv(scheduler)
        if sample.allocated_slots == 0:
            return
        waste = sample.waste
        self.num_samples += 1
        self.total += waste
        self.max = max(self.max, waste)

    def summary(self) -> dict[str, float | int | None]:
        mean = self.total / self.num_samples if self.num_samples else None
        return {
            "kv_waste_mean": mean,
            "kv_waste_max": self.max if self.num_samples else None,
            "kv_waste_samples": self.num_samples,
        }
