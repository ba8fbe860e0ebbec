"""One writer at a time per cache entry, and removal of what killed writers left behind.

An entry ``<folder>/<name>`` is only built or replaced by a process holding an exclusive ``flock``
on ``<folder>/.<name>.lock``; it builds in a scratch sibling ``.tmp-<name>-<id>`` and moves the
old copy aside through ``.stale-<name>-<id>``. The kernel drops a flock when its holder dies,
however it dies (SIGKILL included), so a scratch sibling whose entry lock can be taken has no
live writer and is removed; one whose entry lock is held is another process's work in progress
and is kept.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO

logger = logging.getLogger("platform_core.models")

_SCRATCH = re.compile(r"\.(?:tmp|stale)-(?P<name>.+)-[0-9a-f]{12}")


@contextlib.contextmanager
def entry_lock(target: Path) -> Iterator[None]:
    """Hold ``target``'s entry lock (waiting while another process holds it) and remove the
    scratch siblings in its folder that no live writer owns.

    A folder where the lock file cannot be created (a read-only cache) is used unlocked and
    nothing is removed from it: it can be read, and nothing can be built in it anyway.
    """
    handle = _open_lock(target)
    if handle is None:
        yield
        return
    with handle:
        if not _try_lock(handle):
            logger.info("waiting for another process that is materializing %s", target)
            fcntl.flock(handle, fcntl.LOCK_EX)
        _remove_abandoned_scratch(target)
        yield


@contextlib.contextmanager
def scratch_sibling(target: Path, tag: str) -> Iterator[Path]:
    """A fresh path ``.<tag>-<name>-<id>`` beside ``target`` (not created), removed with whatever
    it holds on exit. Use it only while holding ``target``'s entry lock."""
    path = target.with_name(f".{tag}-{target.name}-{uuid.uuid4().hex[:12]}")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _remove_abandoned_scratch(held: Path) -> None:
    """Remove scratch siblings of ``held`` (whose lock the caller holds) and of every other entry
    of its folder whose lock is free."""
    for path in sorted(held.parent.iterdir()):
        match = _SCRATCH.fullmatch(path.name)
        if match is None or not path.is_dir():
            continue
        if match["name"] == held.name:
            _remove(path)
            continue
        handle = _open_lock(held.with_name(match["name"]))
        if handle is not None:
            with handle:
                if _try_lock(handle):
                    _remove(path)


def _remove(path: Path) -> None:
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    logger.warning("removing %s (%.0f MB) left by an interrupted materialization", path, size / 1e6)
    shutil.rmtree(path, ignore_errors=True)


def _open_lock(target: Path) -> IO[str] | None:
    try:
        return target.with_name(f".{target.name}.lock").open("a")
    except OSError as exc:
        logger.debug("cannot lock %s: %s", target, exc)
        return None


def _try_lock(handle: IO[str]) -> bool:
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
