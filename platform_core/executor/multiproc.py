"""Tensor-parallel ranks as spawned processes on this machine, driven over pipes.

Each step the driver sends the step plan (numpy arrays and ids, small) to every worker, runs its
own share (the collectives meet in the middle), then collects one acknowledgement per worker. A
worker that exits or raises turns into ``WorkerDiedError`` within the worker timeout; the process
group's own timeout bounds a collective whose peer vanished.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from platform_core.distributed.launch import LoopbackGroupConfig, find_free_port
from platform_core.executor.base import (
    LockstepExecutor,
    ModelSpec,
    WorkerDiedError,
    destroy_process_group,
)
from platform_core.executor.lifetime import die_with_parent
from platform_core.executor.messages import RankCall, RankReply, Shutdown, serve_call

logger = logging.getLogger("platform_core.executor")


def _worker_main(
    spec: ModelSpec, group: LoopbackGroupConfig, rank: int, conn: Connection, parent_pid: int
) -> None:
    """A worker process: build the rank, then serve typed calls until ``Shutdown``. It dies with
    the thread that started it (the engine's), even in the middle of a collective."""
    from platform_core.executor.rank import build_rank_runner

    die_with_parent(parent_pid)
    try:
        runner = build_rank_runner(spec, group, rank)
        conn.send(RankReply())
    except Exception:  # reported to the driver, which fails start-up with it
        conn.send(RankReply(error=traceback.format_exc()))
        return
    while True:
        try:
            call = conn.recv()
        except EOFError:  # the driver is gone
            return
        if isinstance(call, Shutdown):
            return
        try:
            conn.send(RankReply(serve_call(runner, call)))
        except Exception:
            conn.send(RankReply(error=traceback.format_exc()))
            return


class MultiprocExecutor(LockstepExecutor):
    """``tensor_parallel_size`` ranks: the driver plus spawned worker processes."""

    def __init__(self, spec: ModelSpec) -> None:
        from platform_core.executor.rank import build_rank_runner

        parallel = spec.config.parallel
        self.timeout = parallel.worker_timeout_s
        group = LoopbackGroupConfig(
            parallel.tensor_parallel_size, find_free_port(), parallel.worker_timeout_s
        )
        context = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        for rank in range(1, group.world_size):
            parent, child = context.Pipe()
            proc = context.Process(
                target=_worker_main,
                args=(spec, group, rank, child, os.getpid()),
                daemon=True,
                name=f"platform-core-rank{rank}",
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        try:
            self.driver = build_rank_runner(spec, group, 0)
            self._gather()
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "tensor parallel: %d ranks (driver + %d worker processes)",
            group.world_size,
            len(self._procs),
        )

    def _send(self, call: RankCall) -> None:
        for conn, proc in zip(self._conns, self._procs):
            try:
                conn.send(call)
            except (BrokenPipeError, OSError) as exc:
                raise WorkerDiedError(f"worker {proc.name} is gone: {exc}") from exc

    def _gather(self) -> list[Any]:
        results = []
        deadline = time.monotonic() + self.timeout
        for conn, proc in zip(self._conns, self._procs):
            while not conn.poll(0.05):
                if not proc.is_alive():
                    raise WorkerDiedError(f"worker {proc.name} exited (code {proc.exitcode})")
                if time.monotonic() > deadline:
                    raise WorkerDiedError(f"worker {proc.name} did not answer in {self.timeout}s")
            try:
                reply: RankReply = conn.recv()
            except EOFError as exc:
                raise WorkerDiedError(f"worker {proc.name} closed its pipe") from exc
            if reply.error is not None:
                raise WorkerDiedError(f"worker {proc.name} failed:\n{reply.error}")
            results.append(reply.value)
        return results

    def check_health(self) -> None:
        for proc in self._procs:
            if not proc.is_alive():
                raise WorkerDiedError(f"worker {proc.name} exited (code {proc.exitcode})")

    def shutdown(self) -> None:
        destroy_process_group()
        for conn in self._conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(Shutdown())
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._conns, self._procs = [], []
