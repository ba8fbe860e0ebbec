"""Collectives over real gloo process groups on loopback, in spawned processes.

Each rank builds deterministic rank-dependent tensors, runs every collective and asserts exact
values against a reference computed locally from every rank's inputs. A rank reports its outcome
(``None`` or a traceback) through a queue; the parent bounds the whole run by a deadline and
terminates any rank that hangs.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from multiproc import run_ranks

from platform_core.distributed.communicator import Communicator, TorchDistributedCommunicator
from platform_core.distributed.launch import (
    LoopbackGroupConfig,
    find_free_port,
    init_loopback_process_group,
)
from platform_core.errors import ConfigError

DTYPES = (torch.float32, torch.bfloat16, torch.int64)
RUN_TIMEOUT_S = 60.0


def _data(rank: int, world_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input: ``[2W, 3W]``, small integers so bfloat16 sums stay exact."""
    shape = (2 * world_size, 3 * world_size)
    return (torch.arange(shape[0] * shape[1]).reshape(shape) + 7 * rank).to(dtype)


# ---------------------------------------------------------------- checks run inside each rank


def _check_collectives(comm: Communicator, dtype: torch.dtype) -> None:
    """Every collective on ``dtype`` against a locally computed reference."""
    world, rank = comm.world_size, comm.rank
    everyone = [_data(q, world, dtype) for q in range(world)]
    total = sum(_data(q, world, torch.int64) for q in range(world)).to(dtype)
    mine = everyone[rank]

    x = mine.clone()
    assert comm.all_reduce(x) is x
    assert torch.equal(x, total)
    strided = mine.clone().t()  # non-contiguous: still reduced in place
    assert comm.all_reduce(strided) is strided
    assert torch.equal(strided, total.t())

    for dim in (0, 1, -1):
        x = mine.clone()
        assert torch.equal(comm.all_gather(x, dim), torch.cat(everyone, dim))
        scattered = comm.reduce_scatter(x, dim)
        assert torch.equal(scattered, total.chunk(world, dim)[rank])
        assert scattered.is_contiguous()
        assert torch.equal(x, mine), "all_gather/reduce_scatter must not modify the input"
    assert torch.equal(comm.all_gather(mine.t(), 0), torch.cat([e.t() for e in everyone], 0))

    expected = torch.cat([e.chunk(world)[rank] for e in everyone])
    x = mine.clone()
    assert torch.equal(comm.all_to_all(x), expected)
    assert torch.equal(x, mine)

    x = mine.clone()
    assert comm.broadcast(x, src=world - 1) is x
    assert torch.equal(x, everyone[world - 1])

    with pytest.raises(ValueError, match="not divisible"):
        comm.all_to_all(torch.zeros(world + 1, dtype=dtype))
    with pytest.raises(ValueError, match="not divisible"):
        comm.reduce_scatter(torch.zeros(2, world + 1, dtype=dtype), dim=1)


def _check_send_recv(comm: Communicator, peer: int, dtype: torch.dtype) -> None:
    """Exchange inputs with ``peer``; the lower rank sends first. Receives into a strided buffer."""
    world, rank = comm.world_size, comm.rank
    mine = _data(rank, world, dtype)
    buffer = torch.zeros(tuple(reversed(mine.shape)), dtype=dtype).t()
    if rank < peer:
        comm.send(mine, peer)
        received = comm.recv(buffer, peer)
    else:
        received = comm.recv(buffer, peer)
        comm.send(mine, peer)
    assert received is buffer
    assert torch.equal(buffer, _data(peer, world, dtype))


def _check_fallbacks(comm: Communicator) -> None:
    """Ops the backend refuses are rebuilt from others, and the refusal is remembered."""
    refused_rs = RuntimeError("Backend gloo does not support reduce_scatter_tensor")
    refused_a2a = NotImplementedError("all_to_all_single")
    with (
        mock.patch.object(dist, "reduce_scatter_tensor", side_effect=refused_rs) as rs,
        mock.patch.object(dist, "all_to_all_single", side_effect=refused_a2a) as a2a,
    ):
        fresh = TorchDistributedCommunicator()
        _check_collectives(fresh, torch.float32)
        _check_collectives(fresh, torch.bfloat16)
    assert rs.call_count == 1 and a2a.call_count == 1

    broken = RuntimeError("Connection reset by peer")
    with mock.patch.object(dist, "reduce_scatter_tensor", side_effect=broken) as rs:
        fresh = TorchDistributedCommunicator()
        for _ in range(2):  # a real failure propagates and is not mistaken for a refusal
            with pytest.raises(RuntimeError, match="Connection reset"):
                fresh.reduce_scatter(_data(comm.rank, comm.world_size, torch.float32))
    assert rs.call_count == 2
    comm.barrier()


def _check_barrier_waits(comm: Communicator) -> None:
    """The other ranks wait in ``barrier`` while the last rank sleeps before entering it."""
    comm.barrier()  # line everyone up first
    last = comm.world_size - 1
    if comm.rank == last:
        time.sleep(0.5)
    start = time.monotonic()
    comm.barrier()
    if comm.rank != last:
        assert time.monotonic() - start >= 0.3


def _listening_addresses() -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """Local addresses of this process's listening TCP sockets (Linux ``/proc``)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # the descriptor listdir itself used, closed since
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    addresses = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in inodes:  # 0A: LISTEN
                    raw = bytes.fromhex(local.split(":")[0])
                    # /proc prints each 32-bit word of the address in host (little-endian) order
                    words = [raw[i : i + 4][::-1] for i in range(0, len(raw), 4)]
                    addresses.append(ipaddress.ip_address(b"".join(words)))
    return addresses


def _is_loopback(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def check_two_ranks(comm: Communicator) -> None:
    """The full suite on the default group of two ranks."""
    assert comm.world_size == 2
    listening = _listening_addresses()
    assert listening, "the process group should be listening somewhere"
    assert all(_is_loopback(address) for address in listening), listening
    for dtype in DTYPES:
        _check_collectives(comm, dtype)
        _check_send_recv(comm, 1 - comm.rank, dtype)
    _check_fallbacks(comm)
    _check_barrier_waits(comm)


def check_three_ranks_and_subgroup(comm: Communicator) -> None:
    """Collectives on three ranks, then a subgroup of global ranks {1, 2} uses group ranks."""
    assert comm.world_size == 3
    _check_collectives(comm, torch.float32)
    subgroup = dist.new_group([1, 2])  # every rank must take part in creating it
    if comm.rank == 0:
        with pytest.raises(ValueError, match="not a member"):
            TorchDistributedCommunicator(group=subgroup)
    else:
        sub = TorchDistributedCommunicator(group=subgroup)
        assert (sub.rank, sub.world_size) == (comm.rank - 1, 2)
        members = [_data(global_rank, 3, torch.float32) for global_rank in (1, 2)]
        mine = members[sub.rank]
        assert torch.equal(sub.all_reduce(mine.clone()), members[0] + members[1])
        assert torch.equal(sub.broadcast(mine.clone(), src=1), members[1])
        _check_send_recv(sub, 1 - sub.rank, torch.int64)
    comm.barrier()


# ---------------------------------------------------------------- tests


def test_two_ranks_run_every_collective_exactly() -> None:
    run_ranks(2, check_two_ranks, RUN_TIMEOUT_S)


def test_three_ranks_and_a_subgroup_use_group_local_ranks() -> None:
    run_ranks(3, check_three_ranks_and_subgroup, RUN_TIMEOUT_S)


def test_world_size_one_needs_no_process_group_and_returns_inputs() -> None:
    assert not dist.is_initialized()
    comm = TorchDistributedCommunicator()
    assert (comm.rank, comm.world_size) == (0, 1)
    x = _data(0, 1, torch.float32)
    for result in (
        comm.all_reduce(x),
        comm.all_gather(x, dim=1),
        comm.reduce_scatter(x, dim=-1),
        comm.broadcast(x, src=0),
        comm.all_to_all(x),
    ):
        assert result is x
    assert torch.equal(x, _data(0, 1, torch.float32))
    comm.barrier()


def test_invalid_arguments_raise_before_communicating() -> None:
    comm = TorchDistributedCommunicator()
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="dst=0"):
        comm.send(x, 0)  # the only rank is this one
    with pytest.raises(ValueError, match="src=1"):
        comm.recv(x, 1)
    with pytest.raises(ValueError, match="src=1"):
        comm.broadcast(x, src=1)
    with pytest.raises(IndexError, match="dim 2"):
        comm.all_gather(x, dim=2)
    with pytest.raises(IndexError, match="dim -3"):
        comm.reduce_scatter(x, dim=-3)
    with pytest.raises(IndexError):
        comm.all_to_all(torch.tensor(1.0))


def test_loopback_config_is_validated_and_stays_on_loopback() -> None:
    port = find_free_port()
    assert 0 < port < 65536
    config = LoopbackGroupConfig(world_size=2, port=port)
    for bad in (
        {"world_size": 0, "port": port},
        {"world_size": 2, "port": 0},
        {"world_size": 2, "port": port, "timeout_s": 0},
    ):
        with pytest.raises(ConfigError):
            LoopbackGroupConfig(**bad)
    with pytest.raises(ConfigError, match="rank"):
        init_loopback_process_group(config, rank=2)


def test_node_group_config_is_validated_and_finds_the_interface_to_its_host() -> None:
    from platform_core.distributed.launch import NodeGroupConfig, interface_towards

    for bad in (
        {"world_size": 2, "host": "", "port": 1234},
        {"world_size": 0, "host": "10.0.0.1", "port": 1234},
        {"world_size": 2, "host": "10.0.0.1", "port": 70000},
    ):
        with pytest.raises(ConfigError):
            NodeGroupConfig(**bad)
    loopback = {name for _, name in socket.if_nameindex()} & {"lo", "lo0"}
    assert interface_towards("127.0.0.2") in loopback  # any 127/8 host is reached by loopback
