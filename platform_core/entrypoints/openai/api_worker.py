"""One of several API-server processes (``serve --api-server-count N``): ``ApiWorkers``, ``main``.

The supervisor (``multi_server``) starts each with ``python -c`` and one framed pickle on stdin
(``WorkerLaunch``): the ``serve`` arguments, the engine cores' addresses, the shared secret and
the inherited listening socket's descriptor. A worker connects to every core as a client that
only detaches on shutdown (the supervisor owns the cores), routes across them when there are
several (``DataParallelEngine``), and serves HTTP on the inherited socket. Workers run in their
own session, so a terminal's Ctrl-C reaches only the supervisor, which forwards one SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass

from platform_core.engine.core_entry import read_launch, write_launch
from platform_core.engine.core_process import CoreAddresses

logger = logging.getLogger("platform_core.server")

_WORKER_MAIN = "from platform_core.entrypoints.openai.api_worker import main; main()"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


@dataclass(frozen=True, slots=True)
class WorkerLaunch:
    """What an API-server process is started with."""

    args: argparse.Namespace
    addresses: list[CoreAddresses]
    secret: bytes | None
    listen_fd: int
    supervisor_pid: int


class ApiWorkers:
    """The API-server processes of one supervisor."""

    def __init__(self, launch: WorkerLaunch, count: int, metrics_dir: str) -> None:
        env = {**os.environ, MULTIPROC_ENV: metrics_dir}
        message = pickle.dumps((sys.path, pickle.dumps(launch)))
        self.processes: list[subprocess.Popen] = []
        for _ in range(count):
            process = subprocess.Popen(
                [sys.executable, "-c", _WORKER_MAIN],
                stdin=subprocess.PIPE,
                pass_fds=(launch.listen_fd,),
                env=env,
                start_new_session=True,
            )
            self.processes.append(process)
            write_launch(process.stdin.fileno(), message)
            process.stdin.close()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    @property
    def alive(self) -> bool:
        return any(p.returncode is None for p in self.processes)

    def reap(self) -> list[int]:
        """Exit statuses of the workers that ended since the last call (logged)."""
        ended = []
        for process in self.processes:
            if process.returncode is None and process.poll() is not None:
                logger.warning("API server %d exited with %d", process.pid, process.returncode)
                ended.append(process.returncode)
        return ended

    def stop(self, timeout: float) -> None:
        """SIGTERM every worker (they drain), wait up to ``timeout`` s, then kill the rest."""
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("API server %d did not stop; killing it", process.pid)
                process.kill()
                process.wait()


def run_worker(launch: WorkerLaunch) -> int:
    """Connect to the engine cores and serve HTTP on the inherited socket; the exit status."""
    from platform_core.engine.core_client import CoreClient
    from platform_core.engine.data_parallel import DataParallelEngine
    from platform_core.engine.setup import load_model_tokenizer
    from platform_core.entrypoints.engine_args import engine_config_from_args
    from platform_core.entrypoints.openai.api_server import (
        api_key_from,
        models_from_args,
        serve_engine,
    )
    from platform_core.executor.lifetime import die_with_parent

    die_with_parent(launch.supervisor_pid, signal.SIGTERM)
    args = launch.args
    logging.basicConfig(
        level=getattr(args, "log_level", "info").upper(),
        format=f"%(levelname)s %(name)s [api server {os.getpid()}]: %(message)s",
    )
    config = engine_config_from_args(args)
    models = models_from_args(args, config)
    tokenizer = load_model_tokenizer(config)
    replicas = []
    try:
        for addresses in launch.addresses:
            replicas.append(
                CoreClient(addresses, tokenizer, launch.secret, stop_core_on_shutdown=False)
            )
    except BaseException:
        for replica in replicas:
            replica.shutdown()
        raise
    routing = config.parallel.data_parallel_routing == "prefix"
    engine = replicas[0] if len(replicas) == 1 else DataParallelEngine(replicas, routing)
    listener = socket.socket(fileno=launch.listen_fd)
    return serve_engine(engine, args, api_key_from(args), models, sockets=[listener])


def main() -> None:
    """Entry of ``python -c``: the launch comes framed on stdin (see ``core_entry``)."""
    sys_path, launch = pickle.loads(read_launch(0))
    sys.path[:0] = [entry for entry in sys_path if entry not in sys.path]
    sys.exit(run_worker(pickle.loads(launch)))
