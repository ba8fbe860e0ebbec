"""The built-in connectors' worker side: serve held blocks, pull missing ones, over a transport.

A producer serves held blocks to consumers through its ``BlockTransport`` (from the transport's
threads, under a lock shared with the engine thread's releases, so a block is never read after
the scheduler may have reused it). A consumer fetches blocks on its own threads; fetched blocks
are checked against the producer's CRC-32s, then written into the cache on the engine thread in
``get_finished``. A block that is missing, damaged or lost with its producer is reported failed;
the scheduler recomputes it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from platform_core.config import KVTransferConfig
from platform_core.kv_transfer.interfaces import (
    KVCacheAccess,
    KVConnectorOutput,
    KVConnectorWorker,
    KVLayout,
    TransferStats,
)
from platform_core.kv_transfer.pull_scheduler import LoadSpec, PullMetadata
from platform_core.kv_transfer.transport import (
    BlockBatch,
    BlockTransport,
    TransferError,
    UnknownTransferError,
)

logger = logging.getLogger("platform_core.kv_transfer")

FETCH_THREADS = 2  # loads in flight at once per consumer
# What a step writes into the cache of fetched blocks at most (``import_bytes_per_step`` in the
# extra config): a large prompt's blocks land over several steps instead of stalling one step
# of the requests decoding meanwhile.
IMPORT_BYTES_PER_STEP = 16 << 20
HOLD_WAIT_S = 2.0  # how long a read waits for the hold it asks for to be registered
# Fetch threads run this much nicer than the engine loop: where they share its cores, receiving
# and checking blocks waits for the decode steps instead of stretching them.
FETCH_NICENESS = 10


def _yield_to_the_engine() -> None:
    """Lower the calling thread's CPU priority (Linux sets it per thread; elsewhere a no-op)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), FETCH_NICENESS)


def crc32_rows(data: torch.Tensor) -> list[int]:
    """The CRC-32 of each row's bytes (rows of a contiguous host tensor)."""
    flat = data.reshape(data.shape[0], -1).view(torch.uint8).numpy() if data.shape[0] else ()
    return [zlib.crc32(row) for row in flat]


@dataclass(slots=True)
class _Fetched:
    """A finished fetch, being written into the cache by the engine thread (``imported`` of
    its intact rows so far)."""

    load: LoadSpec
    batch: BlockBatch | None  # None: the transfer failed as a whole
    intact: list[bool]
    seconds: float
    imported: int = 0

    @property
    def good_rows(self) -> list[int]:
        return [i for i, ok in enumerate(self.intact) if ok] if self.batch is not None else []


class PullWorker(KVConnectorWorker):
    """Worker side of the built-in connectors over ``transport``."""

    def __init__(self, config: KVTransferConfig, transport: BlockTransport):
        self.config = config
        self.transport = transport
        # A producer checksums what it serves unless told not to; consumers check what comes.
        self.verify = bool(config.kv_connector_extra_config.get("verify_checksums", True))
        self.cache: KVCacheAccess | None = None
        self.layout: KVLayout | None = None
        self._lock = threading.Lock()  # holds, served stats, finished_sending
        self._held = threading.Condition(self._lock)  # a hold was registered
        self._holds: dict[str, list[int]] = {}
        self._finished_sending: set[str] = set()
        self._served = TransferStats()
        self._fetched: list[_Fetched] = []  # guarded by _fetched_lock
        self._fetched_lock = threading.Lock()
        self._importing: deque[_Fetched] = deque()  # engine thread: fetched, landing in pieces
        extra = config.kv_connector_extra_config
        self.import_bytes_per_step = int(extra.get("import_bytes_per_step", IMPORT_BYTES_PER_STEP))
        # engine thread only: loads in flight, and those whose request is gone meanwhile
        self._loading: set[str] = set()
        self._abandoned: set[str] = set()
        self._pool: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ engine thread
    def register_kv_caches(self, cache: KVCacheAccess) -> None:
        self.cache = cache
        self.layout = cache.layout
        if self.config.is_producer:
            self.transport.serve(self)
        if self.config.is_consumer:
            self._pool = ThreadPoolExecutor(
                FETCH_THREADS, thread_name_prefix="kv-fetch", initializer=_yield_to_the_engine
            )

    def start_load_kv(self, metadata: PullMetadata) -> None:
        if metadata.holds or metadata.releases:
            with self._held:
                self._holds.update(metadata.holds)
                for request_id in metadata.releases:
                    self._holds.pop(request_id, None)
                self._held.notify_all()
        self._abandoned.update(r for r in metadata.releases if r in self._loading)
        for load in metadata.loads:
            self._loading.add(load.request_id)
            self._submit(self._fetch, load)
        for address, transfer_id in metadata.confirms:
            self._submit(self._confirm, address, transfer_id)

    def save_kv(self, metadata: PullMetadata) -> None:
        """Nothing to do: consumers pull held blocks straight from the cache."""

    def get_finished(self) -> KVConnectorOutput:
        output = KVConnectorOutput()
        with self._lock:
            output.finished_sending, self._finished_sending = self._finished_sending, set()
            output.stats, self._served = self._served, TransferStats()
        with self._fetched_lock:
            self._importing.extend(self._fetched)
            self._fetched = []
        budget = self.import_bytes_per_step
        while self._importing and budget > 0:
            item = self._importing[0]
            budget -= self._import_some(item, budget, output)
            if item.load.request_id in self._abandoned or item.imported == len(item.good_rows):
                self._importing.popleft()
                self._land(item, output)
        return output

    def _import_some(self, item: _Fetched, budget: int, output: KVConnectorOutput) -> int:
        """Write the next intact rows of ``item`` into the cache, about ``budget`` bytes (one
        row at least); the bytes written."""
        good = item.good_rows
        if item.load.request_id in self._abandoned or item.imported == len(good):
            return 0
        data = item.batch.data
        row_bytes = data[0].numel() * data.element_size()
        chunk = good[item.imported : item.imported + max(1, budget // row_bytes)]
        consecutive = chunk[-1] - chunk[0] + 1 == len(chunk)
        rows = data[chunk[0] : chunk[-1] + 1] if consecutive else data[chunk]
        self.cache.import_blocks([item.load.block_ids[i] for i in chunk], rows)
        item.imported += len(chunk)
        written = rows.numel() * rows.element_size()
        output.stats.blocks_received += len(chunk)
        output.stats.bytes_received += written
        return written

    def _land(self, item: _Fetched, output: KVConnectorOutput) -> None:
        """Report a load finished: its blocks that did not arrive intact failed."""
        load, stats = item.load, output.stats
        output.finished_recving.add(load.request_id)
        self._loading.discard(load.request_id)
        if load.request_id in self._abandoned:
            self._abandoned.discard(load.request_id)
            return
        failed = [load.block_ids[i] for i, ok in enumerate(item.intact) if not ok]
        if item.batch is None:
            failed = list(load.block_ids)
        if failed:
            output.failed_blocks[load.request_id] = failed
            stats.failed_blocks += len(failed)
            stats.failed_transfers += 1
        stats.latencies_s.append(item.seconds)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self.transport.close()

    # ------------------------------------------------------------------ fetch threads
    def _submit(self, fn: Any, *args: Any) -> None:
        if self._pool is None:
            logger.warning("a KV load or confirmation for a producer-only instance: ignored")
            return
        self._pool.submit(fn, *args)

    def _fetch(self, load: LoadSpec) -> None:
        start = time.monotonic()
        batch, intact, held = None, [False] * len(load.positions), True
        try:
            batch = self.transport.fetch(
                load.address, load.transfer_id, load.positions, self.layout
            )
            intact = self._check(batch, len(load.positions))
        except TransferError as exc:
            held = not isinstance(exc, UnknownTransferError)
            logger.warning("request %s: KV load failed (%s): recomputing", load.request_id, exc)
        except Exception:  # a broken transport must not kill the fetch thread silently
            logger.exception("request %s: KV load failed: recomputing", load.request_id)
        if held:  # done with it, loaded or not: the producer may free its copy now
            self._confirm(load.address, load.transfer_id)
        with self._fetched_lock:
            self._fetched.append(_Fetched(load, batch, intact, time.monotonic() - start))

    @staticmethod
    def _check(batch: BlockBatch, count: int) -> list[bool]:
        """Which rows arrived: not missing, and matching the producer's checksums (when it made
        them: ``verify_checksums`` is the producer's choice)."""
        if batch.data.shape[0] != count or (batch.checksums and len(batch.checksums) != count):
            return [False] * count
        intact = [True] * count
        for index in batch.missing:
            intact[index] = False
        if batch.checksums:
            for index, (got, sent) in enumerate(zip(crc32_rows(batch.data), batch.checksums)):
                if got != sent:
                    intact[index] = False
        return intact

    def _confirm(self, address: dict[str, Any], transfer_id: str) -> None:
        try:
            self.transport.confirm(address, transfer_id)
        except TransferError as exc:  # the producer frees its copy on its hold timeout
            logger.warning("could not confirm KV transfer %s: %s", transfer_id, exc)

    # ------------------------------------------------------------ BlockSource (transport threads)
    def read(self, transfer_id: str, positions: list[int]) -> BlockBatch:
        """Held blocks ``positions`` of ``transfer_id`` (for a consumer). A consumer may ask
        before the step that registers the hold has started: wait for it a little."""
        with self._held:
            self._held.wait_for(lambda: transfer_id in self._holds, HOLD_WAIT_S)
            blocks = self._holds.get(transfer_id)
            if blocks is None:
                raise UnknownTransferError(f"no KV blocks are held for {transfer_id!r}")
            missing = [i for i, p in enumerate(positions) if not 0 <= p < len(blocks)]
            ids = [blocks[p] if 0 <= p < len(blocks) else blocks[0] for p in positions]
            data = self.cache.export_blocks(ids)
            self._served.blocks_sent += len(ids) - len(missing)
            self._served.bytes_sent += data.numel() * data.element_size()
        checksums = crc32_rows(data) if self.verify else []
        return BlockBatch(data, checksums, missing)

    def confirm(self, transfer_id: str) -> None:
        """A consumer has the blocks of ``transfer_id``: they may be freed."""
        with self._lock:
            if self._holds.pop(transfer_id, None) is not None:
                self._finished_sending.add(transfer_id)
