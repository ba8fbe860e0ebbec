"""Collective checks across spawned ranks, with the backend's own communicator.

Every rank builds the backend, joins a loopback process group whose ``torch.distributed``
backend comes from the backend (:func:`process_group_backend`), runs every collective on every
declared dtype and compares with exact values computed locally from all ranks' inputs (small
integers, exact in every dtype). The parent spawns the ranks once and returns one outcome per
(collective, dtype).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from platform_core.backend_api import (
    Backend,
    Communicator,
    LoopbackGroupConfig,
    find_free_port,
    init_loopback_process_group,
)
from platform_core_conformance.batches import TORCH_DTYPES
from platform_core_conformance.context import create_backend

WORLD_SIZE = 2
RUN_TIMEOUT_S = 120.0
# Used when the backend object names no process-group backend itself.
DEFAULT_PROCESS_GROUPS = {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl"}


def process_group_backend(backend: Backend) -> str | None:
    """The ``torch.distributed`` backend for this backend's collectives: its
    ``process_group_backend`` attribute, else the default for its device type."""
    explicit = getattr(backend, "process_group_backend", None)
    return explicit or DEFAULT_PROCESS_GROUPS.get(backend.device.type)


def devices_short_of_world(backend: Backend) -> str | None:
    """Why the ranks cannot each get a device of ``backend``'s type, or ``None`` if they can.

    Every rank takes device ``LOCAL_RANK``; CPU ranks share the host.
    """
    kind = backend.device.type
    module = getattr(torch, kind, None)
    if kind == "cpu" or module is None or not hasattr(module, "device_count"):
        return None
    count = module.device_count()
    if count >= WORLD_SIZE:
        return None
    return f"needs {WORLD_SIZE} {kind} devices (one per rank), this machine has {count}"


def _data(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input ``[2W, 3W]``: small integers, so every sum is exact."""
    rows, cols = 2 * WORLD_SIZE, 3 * WORLD_SIZE
    return (torch.arange(rows * cols).reshape(rows, cols) % 50 + 7 * rank).to(dtype)


def _all_reduce(comm: Communicator, dtype: torch.dtype, device: torch.device) -> None:
    total = sum(_data(r, torch.int64) for r in range(WORLD_SIZE)).to(dtype)
    x = _data(comm.rank, dtype).to(device)
    assert comm.all_reduce(x) is x, "all_reduce must reduce in place and return its input"
    assert torch.equal(x.cpu(), total)


def _all_gather(comm: Communicator, dtype: torch.dtype, device: torch.device) -> None:
    everyone = [_data(r, dtype) for r in range(WORLD_SIZE)]
    for dim in (0, 1):
        result = comm.all_gather(everyone[comm.rank].to(device), dim)
        assert torch.equal(result.cpu(), torch.cat(everyone, dim)), f"dim={dim}"


def _reduce_scatter(comm: Communicator, dtype: torch.dtype, device: torch.device) -> None:
    total = sum(_data(r, torch.int64) for r in range(WORLD_SIZE)).to(dtype)
    for dim in (0, 1):
        result = comm.reduce_scatter(_data(comm.rank, dtype).to(device), dim)
        assert torch.equal(result.cpu(), total.chunk(WORLD_SIZE, dim)[comm.rank]), f"dim={dim}"


def _broadcast(comm: Communicator, dtype: torch.dtype, device: torch.device) -> None:
    src = WORLD_SIZE - 1
    x = _data(comm.rank, dtype).to(device)
    assert comm.broadcast(x, src=src) is x, "broadcast must fill and return its input"
    assert torch.equal(x.cpu(), _data(src, dtype))


def _send_recv(comm: Communicator, dtype: torch.dtype, device: torch.device) -> None:
    peer = 1 - comm.rank
    mine = _data(comm.rank, dtype).to(device)
    buffer = torch.zeros_like(mine)
    if comm.rank == 0:  # the lower rank sends first, so the pair never waits on each other
        comm.send(mine, peer)
        received = comm.recv(buffer, peer)
    else:
        received = comm.recv(buffer, peer)
        comm.send(mine, peer)
    assert received is buffer, "recv must fill and return its buffer"
    assert torch.equal(buffer.cpu(), _data(peer, dtype))


CHECKS: dict[str, Callable[[Communicator, torch.dtype, torch.device], None]] = {
    "all_reduce": _all_reduce,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "broadcast": _broadcast,
    "send_recv": _send_recv,
}


@dataclass(frozen=True)
class RankJob:
    """What one spawned rank needs (picklable)."""

    backend: str
    extra_plugins: tuple[object, ...]
    group_backend: str
    group: LoopbackGroupConfig
    dtypes: tuple[str, ...]


def _rank_main(job: RankJob, rank: int, results: mp.Queue) -> None:
    """Child entry point: report ``(rank, {(op, dtype): traceback or None}, fatal traceback)``."""
    outcomes: dict[tuple[str, str], str | None] = {}
    fatal = None
    try:
        # The usual launcher variables, so a multi-device backend can pick its device.
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE))
        _, backend = create_backend(job.backend, job.extra_plugins)
        init_loopback_process_group(job.group, rank, backend=job.group_backend)
        comm = backend.communicator()
        assert (comm.rank, comm.world_size) == (rank, WORLD_SIZE), "wrong rank or world size"
        for dtype in job.dtypes:
            for op, check in CHECKS.items():
                try:
                    check(comm, TORCH_DTYPES[dtype], backend.device)
                    outcomes[op, dtype] = None
                except Exception:
                    outcomes[op, dtype] = traceback.format_exc()
    except BaseException:
        fatal = traceback.format_exc()
    finally:
        results.put((rank, outcomes, fatal))
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class CollectiveResults:
    """Per-(collective, dtype) failure text from any rank (``None``: passed on every rank)."""

    outcomes: dict[tuple[str, str], str | None]
    fatal: str | None

    def failure(self, op: str, dtype: str) -> str | None:
        """Why ``op`` on ``dtype`` failed, or ``None`` if it passed on every rank."""
        if self.fatal is not None:
            return self.fatal
        if (op, dtype) not in self.outcomes:
            return "no rank reported this check (a rank hung or died)"
        return self.outcomes[op, dtype]


def run_collectives(
    backend: str, extra_plugins: Sequence[object], group_backend: str, dtypes: Sequence[str]
) -> CollectiveResults:
    """Spawn ``WORLD_SIZE`` ranks, run every check, and merge their outcomes."""
    ctx = mp.get_context("spawn")
    group = LoopbackGroupConfig(WORLD_SIZE, find_free_port(), timeout_s=RUN_TIMEOUT_S / 2)
    job = RankJob(backend, tuple(extra_plugins), group_backend, group, tuple(dtypes))
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(job, rank, results), daemon=True)
        for rank in range(WORLD_SIZE)
    ]
    for proc in procs:
        proc.start()
    reports = _collect(results, procs)
    outcomes: dict[tuple[str, str], str | None] = {}
    fatal = [f"rank {r}:\n{f}" for r, (_, f) in sorted(reports.items()) if f is not None]
    silent = sorted(set(range(WORLD_SIZE)) - reports.keys())
    if silent:
        codes = [procs[r].exitcode for r in silent]
        fatal.append(f"ranks {silent} hung or died without reporting (exit codes {codes})")
    for rank, (rank_outcomes, _) in sorted(reports.items()):
        for key, error in rank_outcomes.items():
            if error is not None:
                outcomes[key] = f"rank {rank}:\n{error}"
            else:
                outcomes.setdefault(key, None)
    return CollectiveResults(outcomes, "\n".join(fatal) or None)


def _collect(results: mp.Queue, procs: list) -> dict[int, tuple[dict, str | None]]:
    """Every rank's report, waiting at most ``RUN_TIMEOUT_S``; hung ranks are terminated."""
    reports: dict[int, tuple[dict, str | None]] = {}
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while len(reports) < len(procs) and time.monotonic() < deadline:
            try:
                rank, outcomes, fatal = results.get(timeout=0.2)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
                continue
            reports[rank] = (outcomes, fatal)
            if fatal is not None:
                break  # the other rank may wait forever on this one
    finally:
        for proc in procs:
            proc.join(timeout=5 if len(reports) == len(procs) else 0.5)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
    return reports
