"""How an engine-core process starts: ``CoreLaunch``, the framed launch message, ``main``.

``ProcessEngine`` runs ``python -c "from platform_core.engine.core_entry import main; main()"``
and writes one length-prefixed pickle to its stdin; ``main`` reads it, puts the front's
``sys.path`` in place, then builds the engine and serves (``run_engine_core``).
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import signal
import struct
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection

from platform_core.config import EngineConfig
from platform_core.engine.core import EngineSetup
from platform_core.engine.core_messages import ENCODER, error_info
from platform_core.engine.core_process import CoreAddresses, CoreServer
from platform_core.engine.llm_engine import LLMEngine
from platform_core.executor.lifetime import die_with_parent


@dataclass(frozen=True, slots=True)
class CoreLaunch:
    """What an engine-core process is started with (pickled once, at its start)."""

    config: EngineConfig
    addresses: CoreAddresses
    secret: bytes | None = None
    engine_setup: EngineSetup | None = None
    log_level: int | None = None  # configure logging to stderr at this level


def run_engine_core(
    launch: CoreLaunch, status: Connection, parent_fd: int | None, parent_pid: int
) -> None:
    """The engine-core process: bind, build the engine, tell ``status`` (an empty message, or
    the encoded ``ErrorInfo`` of the failure), then serve until stopped (or ``parent_fd`` reads
    as closed: the front is gone).

    SIGINT and SIGTERM are ignored: a terminal's Ctrl-C or a supervisor signals the whole
    process group, and the front must first drain its HTTP requests, then stop the core.
    """
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if launch.log_level is not None:
        logging.basicConfig(
            level=launch.log_level, format="%(levelname)s %(name)s [engine core]: %(message)s"
        )
    try:
        server = CoreServer(launch.addresses, launch.secret, parent_fd)
    except Exception as exc:
        status.send_bytes(ENCODER.encode(error_info(exc)))
        return
    try:
        engine = LLMEngine(launch.config)
        if launch.engine_setup is not None:
            launch.engine_setup(engine)
    except BaseException as exc:
        server.close()
        status.send_bytes(ENCODER.encode(error_info(exc)))
        return
    # What start-up left (model, tokenizer, modules) lives as long as the process: moved out of
    # the collector's sight, so the collections that per-step garbage triggers stay short.
    gc.collect()
    gc.freeze()
    status.send_bytes(b"")
    server.serve(engine)


def read_launch(fd: int) -> bytes:
    """One length-prefixed message from ``fd`` (``write_launch``'s)."""
    header = _read_exactly(fd, 8)
    return _read_exactly(fd, struct.unpack("<Q", header)[0])


def write_launch(fd: int, message: bytes) -> None:
    """Write ``message`` to ``fd`` with its length in front."""
    os.write(fd, struct.pack("<Q", len(message)))
    view = memoryview(message)
    while view:
        view = view[os.write(fd, view) :]


def _read_exactly(fd: int, size: int) -> bytes:
    parts, left = [], size
    while left:
        part = os.read(fd, left)
        if not part:
            raise EOFError("the front closed the pipe before the launch was read")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def main() -> None:
    """Entry of ``python -c``: the launch comes on stdin, which then stays open as the sign
    that the front lives. It is pickled twice so the front's ``sys.path`` is in place before
    the launch (and an ``engine_setup`` defined in a test module) is unpickled."""
    sys_path, launch = pickle.loads(read_launch(0))
    sys.path[:0] = [entry for entry in sys_path if entry not in sys.path]
    launch, status_fd, parent_pid = pickle.loads(launch)
    run_engine_core(launch, Connection(status_fd, readable=False), 0, parent_pid)
