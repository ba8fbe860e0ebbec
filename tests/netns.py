"""Two network namespaces joined by a veth pair: two "hosts" on this machine, each with its own
address, for tests of serving across machines. Traffic stays inside the pair."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class HostPair:
    """The two namespaces' names and their addresses on the veth link between them."""

    first: str
    second: str
    first_ip: str
    second_ip: str


def in_namespace(namespace: str, *command: str) -> list[str]:
    """The argv that runs ``command`` inside network namespace ``namespace``."""
    return ["ip", "netns", "exec", namespace, *command]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextmanager
def host_pair(prefix: str, subnet_byte: int) -> Iterator[HostPair]:
    """Make the pair (names from ``prefix`` and this process id, addresses in
    ``10.<subnet_byte>.*.0/24``), remove it afterwards; skip where ``ip netns`` is not permitted."""
    tag = os.getpid() % 100000
    subnet = f"10.{subnet_byte}.{os.getpid() % 200 + 20}"
    pair = HostPair(f"{prefix}a{tag}", f"{prefix}b{tag}", f"{subnet}.1", f"{subnet}.2")
    try:
        _ip("netns", "add", pair.first)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"'ip netns' is not permitted here: {getattr(exc, 'stderr', exc)}")
    try:
        _ip("netns", "add", pair.second)
        first_dev, second_dev = f"{prefix}va{tag}", f"{prefix}vb{tag}"
        _ip("link", "add", first_dev, "type", "veth", "peer", "name", second_dev)
        for ns, dev, address in (
            (pair.first, first_dev, pair.first_ip),
            (pair.second, second_dev, pair.second_ip),
        ):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield pair
    finally:
        for ns in (pair.first, pair.second):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
