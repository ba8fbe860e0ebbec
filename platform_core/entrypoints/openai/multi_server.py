"""``serve`` as a supervisor: engine cores and several API-server processes on one port.

The parent binds the listening socket once and every API server inherits it (``api_worker``).
All of them ``accept`` from the one kernel queue, so a connection waiting there is taken by any
live server, and an API server that dies loses only the connections it had accepted. (With
``SO_REUSEPORT`` each server would own a queue: connections hashed to a dead server's queue would
be reset, any process of the same user could bind the port and take a share of the traffic, and
a port already in use would only be noticed by each child.)

The parent starts the local engine cores (``ProcessEngine``, so it sees them die), waits for
the remote ones to register (``engine.registration``; ``--headless`` is the other end), then
starts the API servers, each a client of every core. It
forwards SIGINT/SIGTERM to the API servers (which drain), then stops the cores. When an engine
core dies (with data parallelism: any of them, as one server would) it stops the API servers and
exits with ``ENGINE_DEATH_EXIT_STATUS`` for a supervisor to restart it. An API server that dies
is logged; the others serve on. Per-request metrics are aggregated over the API servers through
prometheus_client's multiprocess mode, in a private ``PROMETHEUS_MULTIPROC_DIR``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
from typing import Any

from platform_core.config import EngineConfig
from platform_core.engine.core_auth import load_engine_secret
from platform_core.engine.core_process import CoreAddresses
from platform_core.engine.process_engine import ProcessEngine
from platform_core.engine.registration import RegistrationServer, run_headless
from platform_core.entrypoints.openai.api_server import (
    ENGINE_DEATH_EXIT_STATUS,
    api_key_from,
    models_from_args,
)
from platform_core.entrypoints.openai.api_worker import ApiWorkers, WorkerLaunch
from platform_core.errors import ConfigError, EngineConnectionError, EngineDeadError

logger = logging.getLogger("platform_core.server")

LISTEN_BACKLOG = 2048
POLL_S = 0.2
WORKER_STOP_GRACE_S = 10.0  # beyond --shutdown-timeout, before a stuck API server is killed


def needs_supervisor(args: argparse.Namespace) -> bool:
    """Whether ``serve`` runs as a supervisor (several API servers, remote or headless cores)."""
    local = getattr(args, "data_parallel_size_local", None)
    return (
        getattr(args, "api_server_count", 1) > 1
        or getattr(args, "headless", False)
        or (local is not None and local < args.data_parallel_size)
    )


def bind_listener(host: str, port: int) -> socket.socket:
    """The listening TCP socket every API server inherits (raises ``OSError`` if taken)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT after a restart
    sock.bind((host, port))
    sock.listen(LISTEN_BACKLOG)
    sock.set_inheritable(True)
    return sock


def single_replica(config: EngineConfig) -> EngineConfig:
    """``config`` for one data-parallel replica."""
    return dataclasses.replace(
        config, parallel=dataclasses.replace(config.parallel, data_parallel_size=1)
    )


class _StopRequested(Exception):
    """SIGINT or SIGTERM reached the supervisor."""


def _raise_stop(signum: int, frame: Any) -> None:
    raise _StopRequested(signal.Signals(signum).name)


def run_supervised(args: argparse.Namespace) -> int:
    """Run ``serve`` as the supervisor (see the module); the exit status."""
    from platform_core.entrypoints.engine_args import engine_config_from_args

    api_key_from(args)  # before loading anything: a bad key fails fast
    config = engine_config_from_args(args)
    secret = load_engine_secret(args.engine_secret_file)
    if args.headless:
        try:
            run_headless(args, config, secret)
        except EngineDeadError as exc:
            logger.error("%s; exiting", exc)
            return ENGINE_DEATH_EXIT_STATUS
        except EngineConnectionError as exc:
            logger.error("%s; exiting", exc)
            return 1
        return 0
    # Each API server reads --lora-modules again; a bad adapter fails here, before any starts.
    models_from_args(args, config)
    size = config.parallel.data_parallel_size
    local = size if args.data_parallel_size_local is None else args.data_parallel_size_local
    if local > size:
        raise ConfigError(f"--data-parallel-size-local {local} > --data-parallel-size {size}")
    if local < size and (secret is None or args.data_parallel_address is None):
        raise ConfigError(
            "engine cores on other hosts need --data-parallel-address and a shared secret "
            "(--engine-secret-file or $PLATFORM_CORE_ENGINE_SECRET)"
        )
    listener = bind_listener(args.host, args.port)  # before loading anything: fail fast
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    cores: list[ProcessEngine] = []
    registry = None
    metrics_dir = tempfile.mkdtemp(prefix="platform-core-metrics-")
    workers = None
    try:
        cores = [ProcessEngine(single_replica(config), secret=secret) for _ in range(local)]
        addresses: list[CoreAddresses] = [core.addresses for core in cores]
        if local < size:
            registry = RegistrationServer(
                args.data_parallel_address, args.data_parallel_rpc_port, secret
            )
            addresses += registry.wait_for(size - local, args.remote_engine_timeout)
        launch = WorkerLaunch(args, addresses, secret, listener.fileno(), os.getpid())
        workers = ApiWorkers(launch, args.api_server_count, metrics_dir)
        logger.info(
            "serving on http://%s:%d: %d API servers, %d engine cores",
            args.host,
            args.port,
            args.api_server_count,
            size,
        )
        return _supervise(workers, cores, registry)
    except _StopRequested as stop:
        logger.info("%s: draining the API servers, then stopping the engine cores", stop)
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut this short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if workers is not None:
            workers.stop(args.shutdown_timeout + WORKER_STOP_GRACE_S)
        for core in cores:
            core.shutdown()
        if registry is not None:
            registry.close()
        listener.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _supervise(
    workers: ApiWorkers, cores: list[ProcessEngine], registry: RegistrationServer | None
) -> int:
    """Wait until an engine core dies or no API server is left; the exit status."""
    while True:
        time.sleep(POLL_S)
        dead = next((core for core in cores if not core.is_running), None)
        if dead is not None:
            logger.error("an engine core stopped serving (%s); exiting", dead.error)
            return ENGINE_DEATH_EXIT_STATUS
        if registry is not None and registry.lost:
            logger.error("a remote engine host is gone (%s); exiting", registry.lost[0])
            return ENGINE_DEATH_EXIT_STATUS
        statuses = workers.reap()
        if ENGINE_DEATH_EXIT_STATUS in statuses:
            logger.error("an API server lost its engine core; exiting")
            return ENGINE_DEATH_EXIT_STATUS
        if not workers.alive:
            logger.error("every API server is gone; exiting")
            return 1
