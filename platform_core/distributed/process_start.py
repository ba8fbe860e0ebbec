"""Start a child process with a start-up handshake, and fail fast when it dies on the way.

``start_child(target, args, name, method)`` starts ``target(link, *args)`` in a new process and
gives the parent a :class:`ChildProcess`. Parent and child share one duplex pipe. The child
reports ``started`` as soon as it runs (its interpreter is up, the target and arguments are
loaded), then the target does its set-up and calls ``link.ready(value)``; from then on the pipe
belongs to the caller's own protocol. A target that raises before it is ready sends its
traceback, and the parent raises :class:`ProcessStartError` with it; a child that dies silently
(a signal, ``os._exit``, an import failure in a spawned interpreter) is noticed through its
sentinel, and the error names its exit status. :func:`wait_ready` waits on pipes and sentinels
together, so no failure waits for a timeout.

A forked child closes the parent's ends of every start-up pipe it inherited, so each child sees
end-of-file when the parent dies, whichever children were forked after it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from platform_core.distributed.start_method import (
    StartMethod,
    check_main_survives_spawn,
    release_openmp_pools,
)
from platform_core.errors import ProcessStartError

# The parent's end of every start-up pipe this process holds (a forked child closes them).
_PARENT_ENDS: weakref.WeakSet[Connection] = weakref.WeakSet()
_SIGNALLED_EXIT_S = 5.0  # how long a terminated or killed child gets to be gone


@dataclass(frozen=True, slots=True)
class _Started:
    pid: int


@dataclass(frozen=True, slots=True)
class _Ready:
    value: Any


@dataclass(frozen=True, slots=True)
class _Failed:
    traceback: str


class ParentLink:
    """The child's side: its end of the pipe, and the call that says set-up is done."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.is_ready = False

    def ready(self, value: Any = None) -> None:
        """Tell the parent this child is ready (``value`` goes to :func:`wait_ready`)."""
        self.conn.send(_Ready(value))
        self.is_ready = True


def _child_main(target: Callable[..., None], args: tuple, conn: Connection) -> None:
    """Every child's entry point: report, run ``target``, report a failure before ready."""
    for parent_end in list(_PARENT_ENDS):  # inherited by fork; empty in a spawned interpreter
        parent_end.close()
    conn.send(_Started(os.getpid()))
    link = ParentLink(conn)
    try:
        target(link, *args)
    except BaseException:
        if link.is_ready:
            raise  # the caller's protocol reports it (multiprocessing prints it to stderr)
        report = traceback.format_exc()
        try:
            conn.send(_Failed(report))
        except OSError:  # the parent is gone: leave the error where a person can read it
            sys.stderr.write(report)
        raise SystemExit(1) from None
    if not link.is_ready:
        conn.send(_Failed(f"{getattr(target, '__name__', target)} returned before it was ready"))


class ChildProcess:
    """The parent's handle on a started child: its process, its pipe, its start-up state."""

    def __init__(self, process: BaseProcess, conn: Connection, method: StartMethod) -> None:
        self.process = process
        self.conn = conn
        self.method = method
        self.started = False
        self.ready = False
        self.ready_value: Any = None

    @property
    def name(self) -> str:
        """The name the child was started with."""
        return self.process.name

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self.process.pid

    def poll(self) -> None:
        """Take in the start-up reports that have arrived; raise :class:`ProcessStartError` if
        the child failed or died before it was ready. Reads nothing after the ready report."""
        if self.ready:
            return
        alive = self.process.is_alive()  # before draining: a dead child's reports are all in
        try:
            while not self.ready and self.conn.poll():
                self._take(self.conn.recv())
        except (EOFError, OSError):  # the child closed its end: it is gone or going
            alive = False
        if not alive and not self.ready:
            raise ProcessStartError(self._death_report())

    def _take(self, report: _Started | _Ready | _Failed) -> None:
        if isinstance(report, _Started):
            self.started = True
        elif isinstance(report, _Ready):
            self.ready, self.ready_value = True, report.value
        else:
            raise ProcessStartError(
                f"{self.name} (pid {self.pid}) failed while starting:\n{report.traceback}"
            )

    def _death_report(self) -> str:
        self.process.join(timeout=1)
        code = self.process.exitcode
        if code is None:
            status = "closed its pipe"
        elif code < 0:
            status = f"was killed by {signal.Signals(-code).name}"
        else:
            status = f"exited with code {code}"
        stage = "before it was ready" if self.started else "before it started"
        report = f"{self.name} (pid {self.pid}) {status} {stage}"
        if not self.started and self.method.name == "spawn":
            report += (
                " (a spawned child that dies this early failed to import the main module or its "
                "target; its stderr says why)"
            )
        return report

    def stop(self, timeout_s: float = 5.0) -> None:
        """Give the child ``timeout_s`` to exit, then terminate it, then kill it; reap it and
        close the pipe. Idempotent."""
        self.process.join(timeout=timeout_s)
        for end in (self.process.terminate, self.process.kill):
            if not self.process.is_alive():
                break
            end()
            self.process.join(timeout=_SIGNALLED_EXIT_S)
        self.conn.close()


def start_child(
    target: Callable[..., None],
    args: tuple,
    name: str,
    method: StartMethod,
    *,
    daemon: bool = True,
) -> ChildProcess:
    """Start ``target(link, *args)`` in a new process named ``name``; ``link`` is the child's
    :class:`ParentLink`. With spawn, ``target`` and ``args`` must be picklable and the main
    script must survive being re-imported (else :class:`UnguardedMainError` now). A daemonic
    child cannot start children of its own: pass ``daemon=False`` for one that will."""
    if method.name == "spawn":
        check_main_survives_spawn(method.reason)
    else:
        release_openmp_pools()  # again: the parent may have run parallel work since the choice
    context = mp.get_context(method.name)
    parent_end, child_end = context.Pipe(duplex=True)
    _PARENT_ENDS.add(parent_end)
    process = context.Process(
        target=_child_main, args=(target, args, child_end), name=name, daemon=daemon
    )
    try:
        process.start()
    except BaseException:
        parent_end.close()
        raise
    finally:
        child_end.close()
    return ChildProcess(process, parent_end, method)


def wait_ready(children: Sequence[ChildProcess], timeout_s: float) -> list[Any]:
    """Wait until every child is ready; their ready values, in order. Raises
    :class:`ProcessStartError` the moment one fails or dies, or when ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    pending = [c for c in children if not c.ready]
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            names = ", ".join(c.name for c in pending)
            raise ProcessStartError(f"{names} did not become ready in {timeout_s:g} s")
        wait([c.conn for c in pending] + [c.process.sentinel for c in pending], remaining)
        for child in pending:
            child.poll()
        pending = [c for c in pending if not c.ready]
    return [c.ready_value for c in children]
