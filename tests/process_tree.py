"""The process tree, read from /proc, for tests that start and kill processes: who is whose
child, which are zombies, and a subreaper so that orphaned grandchildren stay ours to reap."""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_PR_SET_CHILD_SUBREAPER = 36


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...


def state(pid: int) -> str | None:
    """The process's state letter (``Z``: zombie), or ``None`` when it does not exist."""
    fields = _stat(pid)
    return None if fields is None else fields[0]


def children(pid: int) -> set[int]:
    """The processes whose parent is ``pid``."""
    found = set()
    for entry in Path("/proc").glob("[0-9]*"):
        fields = _stat(int(entry.name))
        if fields is not None and int(fields[1]) == pid:
            found.add(int(entry.name))
    return found


def descendants(pid: int) -> set[int]:
    """Every process below ``pid``."""
    found, frontier = set(), {pid}
    while frontier:
        frontier = set().union(*(children(p) for p in frontier)) - found
        found |= frontier
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def zombies_below(pid: int) -> set[int]:
    """Descendants of ``pid`` that have exited and were never reaped."""
    return {p for p in descendants(pid) if state(p) == "Z"}


def wait_gone(pid: int, timeout: float) -> bool:
    """Whether ``pid`` stopped running (gone, or a zombie) within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while state(pid) not in (None, "Z"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@contextmanager
def subreaper() -> Iterator[None]:
    """While inside, this process adopts orphaned descendants (reap them with ``reap``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    try:
        yield
    finally:
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def reap(pid: int, timeout: float) -> int:
    """Wait for child ``pid`` to exit and reap it; its wait status."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} did not exit in {timeout} s")
        time.sleep(0.02)
