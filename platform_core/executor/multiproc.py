"""Tensor-parallel ranks as worker processes on this machine, driven over pipes.

Workers start by fork where that is safe and by spawn otherwise (``worker_start_method``; see
``platform_core.distributed.start_method``), through ``start_child``'s handshake: a worker that
dies or raises while starting, before, during or after the rendezvous, fails the driver at once
with its traceback or exit status, as ``WorkerDiedError``. Each step the driver sends the step
plan (numpy arrays and ids, small) to every worker, runs its own share (the collectives meet in
the middle), then collects one acknowledgement per worker. A worker that exits or raises turns
into ``WorkerDiedError`` within the worker timeout; the process group's own timeout bounds a
collective whose peer vanished.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import traceback
from typing import Any

from platform_core.distributed.launch import LoopbackGroupConfig, find_free_port
from platform_core.distributed.process_start import (
    ChildProcess,
    ParentLink,
    start_child,
    wait_ready,
)
from platform_core.distributed.start_method import choose_start_method
from platform_core.errors import ProcessStartError
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
    link: ParentLink, spec: ModelSpec, group: LoopbackGroupConfig, rank: int, parent_pid: int
) -> None:
    """A worker process: build the rank, then serve typed calls until ``Shutdown``. It dies with
    the thread that started it (the engine's), even in the middle of a collective."""
    from platform_core.executor.rank import build_rank_runner

    die_with_parent(parent_pid)
    runner = build_rank_runner(spec, group, rank)
    link.ready()
    conn = link.conn
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
    """``tensor_parallel_size`` ranks: the driver plus worker processes."""

    def __init__(self, spec: ModelSpec) -> None:
        from platform_core.executor.rank import build_rank_runner

        parallel = spec.config.parallel
        self.timeout = parallel.worker_timeout_s
        group = LoopbackGroupConfig(
            parallel.tensor_parallel_size, find_free_port(), parallel.worker_timeout_s
        )
        self.start_method = choose_start_method(parallel.worker_start_method)
        self._procs: list[ChildProcess] = []
        try:
            for rank in range(1, group.world_size):
                name = f"platform-core-rank{rank}"
                args = (spec, group, rank, os.getpid())
                self._procs.append(start_child(_worker_main, args, name, self.start_method))
            try:
                self.driver = build_rank_runner(spec, group, 0, while_waiting=self._poll_workers)
            except ProcessStartError:
                raise
            except Exception:
                self._poll_workers()  # a dead worker explains a failed join better than the join
                raise
            wait_ready(self._procs, self.timeout)
        except ProcessStartError as exc:
            self.shutdown()
            raise WorkerDiedError(str(exc)) from exc
        except BaseException:
            self.shutdown()
            raise
        self.worker_pids = [proc.pid for proc in self._procs]
        logger.info(
            "tensor parallel: %d ranks (driver + %d worker processes; %s)",
            group.world_size,
            len(self._procs),
            self.start_method.reason,
        )

    def _poll_workers(self) -> None:
        for proc in self._procs:
            proc.poll()

    def _send(self, call: RankCall) -> None:
        for proc in self._procs:
            try:
                proc.conn.send(call)
            except (BrokenPipeError, OSError) as exc:
                raise WorkerDiedError(f"worker {proc.name} is gone: {exc}") from exc

    def _gather(self) -> list[Any]:
        results = []
        deadline = time.monotonic() + self.timeout
        for proc in self._procs:
            conn = proc.conn
            while not conn.poll(0.05):
                if not proc.process.is_alive():
                    raise WorkerDiedError(
                        f"worker {proc.name} exited (code {proc.process.exitcode})"
                    )
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
            if not proc.process.is_alive():
                raise WorkerDiedError(f"worker {proc.name} exited (code {proc.process.exitcode})")

    def shutdown(self) -> None:
        destroy_process_group()
        for proc in self._procs:
            with contextlib.suppress(BrokenPipeError, OSError):
                proc.conn.send(Shutdown())
        for proc in self._procs:
            proc.stop(timeout_s=5 if proc.ready else 0)  # one still starting never reads Shutdown
        self._procs = []
