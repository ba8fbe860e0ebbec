"""A fault-injecting transport for tests and vendors' conformance runs: it wraps a real one and
delays fetches, drops them, damages or withholds blocks, or never confirms.

Configured through ``kv_connector_extra_config`` of the ``faults`` connector (every key
optional): ``transport`` (the wrapped one: ``loopback``, ``tcp`` or ``shm``; default
``loopback``), ``delay_s`` (before each fetch), ``fail_fetches`` (the first N fetches fail as a
lost connection), ``corrupt_positions`` / ``missing_positions`` (indexes into each fetch's asked
blocks, damaged in transit / reported missing), ``drop_confirms`` (never tell the producer: it
frees on its hold timeout).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, fields
from typing import Any

import torch

from platform_core.errors import ConfigError
from platform_core.kv_transfer.interfaces import KVLayout
from platform_core.kv_transfer.transport import (
    BlockBatch,
    BlockSource,
    BlockTransport,
    TransferError,
)


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """Which faults to inject (see the module docstring)."""

    transport: str = "loopback"
    delay_s: float = 0.0
    fail_fetches: int = 0
    corrupt_positions: tuple[int, ...] = ()
    missing_positions: tuple[int, ...] = ()
    drop_confirms: bool = False

    @classmethod
    def parse(cls, extra: dict[str, Any]) -> FaultPlan:
        """From a connector's extra config; unknown keys raise ``ConfigError``."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known - {"verify_checksums", "advertise_host"})
        if unknown:
            raise ConfigError(f"unknown faults key(s) {unknown}; valid keys: {sorted(known)}")
        values = {k: v for k, v in extra.items() if k in known}
        for key in ("corrupt_positions", "missing_positions"):
            if key in values:
                values[key] = tuple(values[key])
        return cls(**values)


class FaultyTransport(BlockTransport):
    """``inner`` with the faults of ``plan`` injected on the consumer's side."""

    def __init__(self, inner: BlockTransport, plan: FaultPlan):
        self.inner = inner
        self.plan = plan
        self._lock = threading.Lock()
        self._fetches = 0

    def serve(self, source: BlockSource) -> None:
        self.inner.serve(source)

    def address(self) -> dict[str, Any]:
        return self.inner.address()

    def fetch(
        self, address: dict[str, Any], transfer_id: str, positions: list[int], layout: KVLayout
    ) -> BlockBatch:
        plan = self.plan
        with self._lock:
            self._fetches += 1
            dropped = self._fetches <= plan.fail_fetches
        if plan.delay_s:
            time.sleep(plan.delay_s)
        if dropped:
            raise TransferError("injected fault: the connection to the producer was lost")
        batch = self.inner.fetch(address, transfer_id, positions, layout)
        count = len(positions)
        for index in plan.corrupt_positions:
            if index < count:
                batch.data[index].view(torch.uint8).bitwise_not_()  # every byte of the block
        missing = {i for i in plan.missing_positions if i < count} | set(batch.missing)
        return BlockBatch(batch.data, batch.checksums, sorted(missing))

    def confirm(self, address: dict[str, Any], transfer_id: str) -> None:
        if not self.plan.drop_confirms:
            self.inner.confirm(address, transfer_id)

    def close(self) -> None:
        self.inner.close()
