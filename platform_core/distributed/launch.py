"""Start a gloo process group: on the loopback interface (one machine), or across machines.

The parent picks a free port with :func:`find_free_port` and hands every rank the same
:class:`LoopbackGroupConfig`; each rank then calls :func:`init_loopback_process_group`. Nothing
listens on or connects to any address but 127.0.0.1. That is why the rendezvous store is built
here rather than from a ``tcp://127.0.0.1:PORT`` init method: the store behind such a URL listens
on every interface whatever host it names, so rank 0 binds the port on loopback itself and hands
the listening socket to the store. gloo's own connections are pinned to the loopback interface.

Ranks on several machines (Ray placing tensor-parallel ranks across nodes) use a
:class:`NodeGroupConfig` and :func:`init_node_process_group` instead: rank 0 hosts the store on one
of its own addresses that every rank reaches, and each rank runs gloo over the interface its route
to that address leaves by. Nothing listens on any other interface.

Rank 0 can watch the others while it waits for them (``while_waiting``: a parent that started
the other ranks raises there the moment one of them dies). It never blocks inside the store:
every rank counts itself in under one key and rank 0 polls that count. Then torch builds the
group, which blocks until every rank is in it; rank 0 runs that on a helper thread and keeps
watching. A watcher that raises abandons the helper: it ends when torch's set-up fails or times
out, and leaves a group it formed after all.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from platform_core.errors import ConfigError, ProcessStartError

LOOPBACK_HOST = "127.0.0.1"
_LOOPBACK_INTERFACES = ("lo", "lo0")  # Linux, macOS/BSD
_JOINED_KEY = "platform_core/ranks_joined"
_JOIN_POLL_S = 0.05
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def find_free_port(host: str = LOOPBACK_HOST) -> int:
    """A TCP port on ``host`` (127.0.0.1 by default) that was free a moment ago (the OS picks it;
    binding port 0).

    Another process may take it before the group starts; callers that must never race retry.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _check_group_shape(world_size: int, port: int, timeout_s: float) -> None:
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    if not 0 < port < 65536:
        raise ConfigError(f"port must be in [1, 65535], got {port}")
    if timeout_s <= 0:
        raise ConfigError(f"timeout_s must be > 0, got {timeout_s}")


@dataclass(frozen=True, slots=True)
class LoopbackGroupConfig:
    """What every rank of a loopback gloo group must agree on; picklable for child processes.

    Rank 0 hosts the rendezvous store on ``127.0.0.1:port``.
    """

    world_size: int
    port: int
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        _check_group_shape(self.world_size, self.port, self.timeout_s)


@dataclass(frozen=True, slots=True)
class NodeGroupConfig:
    """What every rank of a gloo group spanning machines must agree on; picklable.

    Rank 0 hosts the rendezvous store on ``host:port``: ``host`` is an IPv4 address of rank 0's
    machine that every rank reaches (a Ray node address, say).
    """

    world_size: int
    host: str
    port: int
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        _check_group_shape(self.world_size, self.port, self.timeout_s)
        if not self.host:
            raise ConfigError("host must name rank 0's address")


def init_loopback_process_group(
    config: LoopbackGroupConfig,
    rank: int,
    backend: str = "gloo",
    while_waiting: Callable[[], None] | None = None,
) -> None:
    """Join the default process group described by ``config`` as ``rank``.

    ``backend`` is the torch.distributed backend (``"gloo"`` for CPU tensors; a GPU backend
    passes its own, e.g. ``"nccl"``). Rank 0 calls ``while_waiting`` (if given) every few
    milliseconds until the others have joined the store; whatever it raises ends the wait.

    Blocks until all ``world_size`` ranks have joined (``ProcessStartError`` once ``timeout_s``
    passes without them; a rank that dies inside torch's own group set-up, after joining the
    store, is noticed when that set-up times out). Sets
    ``GLOO_SOCKET_IFNAME`` to the loopback interface for this process, overriding any other
    value, so this group and any subgroup created later stay on loopback. Tear down with
    ``torch.distributed.destroy_process_group()``.
    """
    _join_group(config, LOOPBACK_HOST, _loopback_interface(), rank, backend, while_waiting)


def init_node_process_group(
    config: NodeGroupConfig,
    rank: int,
    backend: str = "gloo",
    while_waiting: Callable[[], None] | None = None,
) -> None:
    """Join the group ``config`` describes as ``rank``, from whichever machine this rank is on.

    As :func:`init_loopback_process_group`, except that the store is on ``config.host`` and
    ``GLOO_SOCKET_IFNAME`` names the interface this machine reaches ``config.host`` by (the
    loopback one on rank 0's machine when ``host`` is a loopback address).
    """
    interface = interface_towards(config.host)
    _join_group(config, config.host, interface, rank, backend, while_waiting)


def _join_group(
    config: LoopbackGroupConfig | NodeGroupConfig,
    host: str,
    interface: str,
    rank: int,
    backend: str,
    while_waiting: Callable[[], None] | None,
) -> None:
    if not 0 <= rank < config.world_size:
        raise ConfigError(f"rank must be in [0, {config.world_size}), got {rank}")
    os.environ["GLOO_SOCKET_IFNAME"] = interface
    timeout = timedelta(seconds=config.timeout_s)
    listen_fd = None
    if rank == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            server.bind((host, config.port))
            server.listen()
            listen_fd = server.detach()  # the store now owns (and closes) the socket
    store = dist.TCPStore(
        host,
        config.port,
        world_size=config.world_size,
        is_master=rank == 0,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=listen_fd,
    )
    store.add(_JOINED_KEY, 1)
    join = functools.partial(
        dist.init_process_group,
        backend,
        store=store,
        rank=rank,
        world_size=config.world_size,
        timeout=timeout,
    )
    if rank != 0:
        join()
        return
    _wait_for_ranks(store, config, host, while_waiting)
    if while_waiting is None:
        join()
    else:
        _WatchedGroupInit(join).run(while_waiting)


def _wait_for_ranks(
    store: dist.Store,
    config: LoopbackGroupConfig | NodeGroupConfig,
    host: str,
    while_waiting: Callable[[], None] | None,
) -> None:
    """Until every rank has counted itself in under ``_JOINED_KEY``, or ``timeout_s`` passes."""
    deadline = time.monotonic() + config.timeout_s
    while (joined := store.add(_JOINED_KEY, 0)) < config.world_size:
        if while_waiting is not None:
            while_waiting()
        if time.monotonic() > deadline:
            raise ProcessStartError(
                f"{joined} of {config.world_size} ranks joined the group on "
                f"{host}:{config.port} in {config.timeout_s:g} s"
            )
        time.sleep(_JOIN_POLL_S)


class _WatchedGroupInit:
    """``join()`` (torch's group set-up) on a helper thread, watched from the caller's."""

    def __init__(self, join: Callable[[], None]) -> None:
        self._join = join
        self._lock = threading.Lock()
        self._finished = self._abandoned = False
        self._error: BaseException | None = None

    def run(self, while_waiting: Callable[[], None]) -> None:
        """Form the group, calling ``while_waiting`` until it is formed; re-raise its error."""
        helper = threading.Thread(target=self._init, name="platform-core-group-init", daemon=True)
        helper.start()
        helper.join(_JOIN_POLL_S)
        while helper.is_alive():
            try:
                while_waiting()
            except BaseException:
                with self._lock:
                    self._abandoned = not self._finished
                raise
            helper.join(_JOIN_POLL_S)
        if self._error is not None:
            raise self._error

    def _init(self) -> None:
        try:
            self._join()
        except BaseException as exc:  # handed to the watching thread, if it still waits
            self._error = exc
        with self._lock:
            self._finished = True
            if self._abandoned and self._error is None:
                dist.destroy_process_group()


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


def interface_towards(host: str) -> str:
    """Name of the network interface this machine reaches ``host`` (IPv4) by (Linux)."""
    address = socket.gethostbyname(host)
    if ipaddress.ip_address(address).is_loopback:
        return _loopback_interface()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))  # connecting a UDP socket sends nothing; it picks the route
        local = probe.getsockname()[0]
    for _, name in socket.if_nameindex():
        if _ipv4_address(name) == local:
            return name
    raise ProcessStartError(
        f"no network interface has {local}, the address this machine reaches {host} from"
    )


def _ipv4_address(interface: str) -> str | None:
    """The IPv4 address of ``interface``, or None where it has none."""
    import fcntl  # POSIX only; a group across machines is supported on Linux

    request = struct.pack("256s", interface.encode()[:15])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
        except OSError:
            return None
    return socket.inet_ntoa(reply[20:24])
