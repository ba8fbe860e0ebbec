"""Start a gloo process group confined to the loopback interface (tests, the CPU backend).

The parent picks a free port with :func:`find_free_port` and hands every rank the same
:class:`LoopbackGroupConfig`; each rank then calls :func:`init_loopback_process_group`. Nothing
listens on or connects to any address but 127.0.0.1. That is why the rendezvous store is built
here rather than from a ``tcp://127.0.0.1:PORT`` init method: the store behind such a URL listens
on every interface whatever host it names, so rank 0 binds the port on loopback itself and hands
the listening socket to the store. gloo's own connections are pinned to the loopback interface.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from platform_core.errors import ConfigError

LOOPBACK_HOST = "127.0.0.1"
_LOOPBACK_INTERFACES = ("lo", "lo0")  # Linux, macOS/BSD


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it; binding port 0).

    Another process may take it before the group starts; callers that must never race retry.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK_HOST, 0))
        return probe.getsockname()[1]


@dataclass(frozen=True, slots=True)
class LoopbackGroupConfig:
    """What every rank of a loopback gloo group must agree on; picklable for child processes.

    Rank 0 hosts the rendezvous store on ``127.0.0.1:port``.
    """

    world_size: int
    port: int
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 < self.port < 65536:
            raise ConfigError(f"port must be in [1, 65535], got {self.port}")
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s must be > 0, got {self.timeout_s}")


def init_loopback_process_group(
    config: LoopbackGroupConfig, rank: int, backend: str = "gloo"
) -> None:
    """Join the default process group described by ``config`` as ``rank``.

    ``backend`` is the torch.distributed backend (``"gloo"`` for CPU tensors; a GPU backend
    passes its own, e.g. ``"nccl"``).

    Blocks until all ``world_size`` ranks have joined (or ``timeout_s`` passes). Sets
    ``GLOO_SOCKET_IFNAME`` to the loopback interface for this process, overriding any other
    value, so this group and any subgroup created later stay on loopback. Tear down with
    ``torch.distributed.destroy_process_group()``.
    """
    if not 0 <= rank < config.world_size:
        raise ConfigError(f"rank must be in [0, {config.world_size}), got {rank}")
    os.environ["GLOO_SOCKET_IFNAME"] = _loopback_interface()
    timeout = timedelta(seconds=config.timeout_s)
    listen_fd = None
    if rank == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            server.bind((LOOPBACK_HOST, config.port))
            server.listen()
            listen_fd = server.detach()  # the store now owns (and closes) the socket
    store = dist.TCPStore(
        LOOPBACK_HOST,
        config.port,
        world_size=config.world_size,
        is_master=rank == 0,
        timeout=timeout,
        master_listen_fd=listen_fd,
    )
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=config.world_size, timeout=timeout
    )


def _loopback_interface() -> str:
    """Name of this machine's loopback network interface."""
    names = {name for _, name in socket.if_nameindex()}
    for candidate in _LOOPBACK_INTERFACES:
        if candidate in names:
            return candidate
    raise RuntimeError(
        f"no loopback network interface found (looked for {_LOOPBACK_INTERFACES}; "
        f"have {sorted(names)})"
    )
