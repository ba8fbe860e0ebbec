"""Run a check on every rank of a loopback gloo group, in spawned processes (test helper).

``run_ranks(world_size, check)`` starts ``world_size`` processes; each joins the default group
and calls ``check(communicator)``. ``check`` must be picklable (a module-level function, or a
``functools.partial`` of one). A rank reports ``None`` or its traceback through a queue; the
parent bounds the whole run by a deadline, terminates ranks that hang once another has failed,
and fails with every reported traceback. Each rank gets an equal share of the CPU cores as
intra-op threads.

``new_children(before)`` is what a test left behind (``process_tree`` reads the tree);
``run_adopting_orphans`` runs a command and returns the processes it left behind after it exited.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import subprocess
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from platform_core.distributed.communicator import Communicator, TorchDistributedCommunicator
from platform_core.distributed.launch import (
    LoopbackGroupConfig,
    find_free_port,
    init_loopback_process_group,
)
from tests.process_tree import children as children_of
from tests.process_tree import subreaper

RankCheck = Callable[[Communicator], None]


def _rank_main(config: LoopbackGroupConfig, rank: int, check: RankCheck, results: mp.Queue) -> None:
    """Child entry point: join the group, run ``check``, report ``(rank, traceback or None)``."""
    error = None
    try:
        # ranks share the machine's cores; oversubscribed intra-op threads slow each one down
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.world_size))
        init_loopback_process_group(config, rank)
        check(TorchDistributedCommunicator())
    except BaseException:
        error = traceback.format_exc()
    finally:
        results.put((rank, error))
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(procs: list, results: mp.Queue, deadline: float) -> dict[int, str | None]:
    """Reports until every rank has reported, one has failed, one died silently, or time is up."""
    reports: dict[int, str | None] = {}
    while len(reports) < len(procs) and time.monotonic() < deadline:
        try:
            rank, error = results.get(timeout=0.2)
        except queue.Empty:
            if any(not p.is_alive() and r not in reports for r, p in enumerate(procs)):
                time.sleep(1.0)  # a dead rank's report may still be in flight
                while not results.empty():
                    rank, error = results.get()
                    reports[rank] = error
                return reports
            continue
        reports[rank] = error
        if error is not None:
            return reports  # the others may now wait forever on the failed rank
    return reports


def run_ranks(world_size: int, check: RankCheck, timeout_s: float = 60.0) -> None:
    """Run ``check`` on ``world_size`` spawned ranks; AssertionError with any rank's traceback,
    or naming the ranks that hung or died without reporting."""
    ctx = mp.get_context("spawn")
    config = LoopbackGroupConfig(world_size, find_free_port(), timeout_s=timeout_s / 2)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(config, rank, check, results), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    reports: dict[int, str | None] = {}
    try:
        reports = _collect(procs, results, time.monotonic() + timeout_s)
    finally:
        for proc in procs:
            # A rank that reported still tears down torch and gloo: on loaded cores that took
            # over 5 s once, and terminating it then failed a passing test.
            proc.join(timeout=30 if len(reports) == world_size else 0.1)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
    failed = {rank: error for rank, error in reports.items() if error is not None}
    assert not failed, "\n".join(f"rank {r} failed:\n{e}" for r, e in sorted(failed.items()))
    silent = sorted(set(range(world_size)) - reports.keys())
    codes = {rank: procs[rank].exitcode for rank in silent}
    assert not silent, f"ranks {silent} hung or died without reporting (exit codes {codes})"
    assert all(proc.exitcode == 0 for proc in procs), [proc.exitcode for proc in procs]


_ORPHAN_GRACE_S = 10.0


def _is_resource_tracker(pid: int) -> bool:
    """multiprocessing's resource tracker: started with the first spawned child, it lives as
    long as this process by design."""
    try:
        return b"resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def new_children(before: set[int]) -> set[int]:
    """This process's children, running or unreaped, that are not in ``before``."""
    return {p for p in children_of(os.getpid()) - before if not _is_resource_tracker(p)}


def _reaped(pid: int) -> bool:
    """Reap child ``pid`` if it has exited; whether it is gone."""
    try:
        return os.waitpid(pid, os.WNOHANG) != (0, 0)
    except ChildProcessError:
        return True


def run_adopting_orphans(
    command: list[str], env: dict[str, str], timeout: float
) -> tuple[subprocess.CompletedProcess, set[int]]:
    """Run ``command``; its result and the processes it left running after it exited.

    This process adopts ``command``'s orphans meanwhile (it is their child subreaper), so they
    can be seen; each gets a few seconds to exit (processes stopped at exit take a moment), then
    the ones still running are killed. All are reaped.
    """
    before = children_of(os.getpid())
    with subreaper():
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    adopted = children_of(os.getpid()) - before
    deadline = time.monotonic() + _ORPHAN_GRACE_S
    running = set(adopted)
    while running and time.monotonic() < deadline:
        running = {pid for pid in running if not _reaped(pid)}
        time.sleep(0.1)
    for pid in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return result, running
