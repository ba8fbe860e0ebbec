"""Throughput and latency of the KV transports (issue #23) beside what they are built from.

A producer process serves a prompt's blocks (already exported: ``read`` hands out a prepared
tensor, so the cache's own gather is not counted) and this process, the consumer, fetches them
again and again, each fetch into a new tensor as the connector does. Rows, per prompt length:

- ``socket``: the baseline of ``tcp``: a small request on a loopback TCP connection, answered
  with ``sendall`` of the same bytes from the producer process, received with ``recv_into`` a
  new tensor;
- ``tcp``, ``tcp+crc``: ``TcpTransport.fetch``; ``+crc``: the producer computes each block's
  ``zlib.crc32`` on every read and the consumer checks them after the fetch (what the connector
  does with ``verify_checksums``);
- ``memcpy``: the baseline of ``shm``: a new tensor and a torch copy of the same bytes into it
  (one copy, in this process);
- ``shm``, ``shm+crc``: ``ShmTransport.fetch`` (the producer copies into its segment, the
  consumer copies out, overlapping chunk by chunk).

New tensors come from ``framing.empty_host`` in every row, so all of them pay the same for
fresh memory. The default layout is SmolLM2-135M's (30 layers, 3 KV heads, head size 64, bf16,
block 16: 360 KiB a block); ``--tokens 2048,8192`` gives 128 and 512 blocks. The rows take
turns, one fetch each per round (``--warmup`` rounds, then ``--iters`` timed), so load from
elsewhere falls on all of them alike. GB/s is bytes over the median fetch time, p50/p99 are of
single fetches, the ratio is to the row's baseline. Each process runs torch on ``--threads``
threads (default: half the cores). Printed with the CPU's features and the load average.

    python benchmarks/kv_transfer.py [--tokens 2048,8192] [--iters 30] [--warmup 3]
        [--threads N] [--layers 30] [--kv-heads 3] [--head-size 64] [--block-size 16]
        [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import struct
import threading
import time
import zlib
from collections.abc import Callable
from multiprocessing.synchronize import Event
from typing import Any

import torch

from platform_core.bench.report import cpu_flags
from platform_core.kv_transfer.framing import byte_view, empty_host, recv_exact_into
from platform_core.kv_transfer.interfaces import KVLayout
from platform_core.kv_transfer.shm_transport import ShmTransport
from platform_core.kv_transfer.tcp_transport import TcpTransport
from platform_core.kv_transfer.transport import BlockBatch, BlockTransport

TRANSPORTS: dict[str, type[BlockTransport]] = {"tcp": TcpTransport, "shm": ShmTransport}
_TOKENS = struct.Struct("!Q")  # the socket baseline's request: which prompt


def crc32_rows(data: torch.Tensor) -> list[int]:
    """Each block's CRC-32, as the connector makes them."""
    return [zlib.crc32(byte_view(row)) for row in data]


class PreparedSource:
    """Serves, under transfer id ``"<tokens>"``, that prompt's prepared tensor whatever the
    positions (``checksum``: a CRC-32 per block on each read, as the connector makes them)."""

    def __init__(self, layout: KVLayout, prompts: dict[int, torch.Tensor], checksum: bool):
        self.layout = layout
        self.prompts = prompts
        self.checksum = checksum

    def read(self, transfer_id: str, positions: list[int]) -> BlockBatch:
        data = self.prompts[int(transfer_id)]
        return BlockBatch(data, crc32_rows(data) if self.checksum else [])

    def confirm(self, transfer_id: str) -> None:
        pass


def prompts_of(layout: KVLayout, tokens: list[int]) -> dict[int, torch.Tensor]:
    dtype = getattr(torch, layout.dtype)
    return {
        n: torch.randn(-(-n // layout.block_size), *layout.block_shape).to(dtype) for n in tokens
    }


def answer_sockets(listener: socket.socket, prompts: dict[int, torch.Tensor]) -> None:
    """The socket baseline's producer: one prompt's bytes for each request, until hung up."""
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    request = bytearray(_TOKENS.size)
    with conn:
        while conn.recv_into(request, _TOKENS.size, socket.MSG_WAITALL) == _TOKENS.size:
            conn.sendall(byte_view(prompts[_TOKENS.unpack(request)[0]]))


def produce(
    layout: KVLayout, tokens: list[int], threads: int, addresses: mp.Queue, stop: Event
) -> None:
    """The producer process: every transport (with and without checksums) and the socket
    baseline serving the same prompts, until ``stop``."""
    torch.set_num_threads(threads)
    prompts = prompts_of(layout, tokens)
    producers: dict[str, BlockTransport] = {}
    for kind, transport in TRANSPORTS.items():
        for crc in (False, True):
            producer = transport("127.0.0.1", 0)
            producer.serve(PreparedSource(layout, prompts, crc))
            producers[kind + "+crc" * crc] = producer
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=answer_sockets, args=(listener, prompts), daemon=True).start()
    found = {name: p.address() for name, p in producers.items()}
    addresses.put({**found, "socket": listener.getsockname()[1]})
    stop.wait()
    for producer in producers.values():
        producer.close()
    listener.close()


class Case:
    """One row: ``fetch`` moves one prompt's bytes once."""

    def __init__(self, name: str, fetch: Callable[[], object]):
        self.name = name
        self.fetch = fetch
        self.seconds: list[float] = []

    def time_one(self) -> None:
        started = time.perf_counter()
        self.fetch()
        self.seconds.append(time.perf_counter() - started)


def cases(
    layout: KVLayout,
    tokens: int,
    data: torch.Tensor,
    addresses: dict[str, Any],
    conn: socket.socket,
    consumers: dict[str, BlockTransport],
) -> list[Case]:
    """The rows for one prompt: ``conn`` reaches the socket baseline's producer."""
    positions = list(range(data.shape[0]))

    def fetch_socket() -> None:
        conn.sendall(_TOKENS.pack(tokens))
        recv_exact_into(conn, byte_view(empty_host(data.shape, data.dtype)))

    def fetch(name: str) -> None:
        consumer = consumers[name.split("+")[0]]
        batch = consumer.fetch(addresses[name], str(tokens), positions, layout)
        if name.endswith("+crc") and crc32_rows(batch.data) != batch.checksums:
            raise AssertionError("checksums differ")

    rows = [Case("socket", fetch_socket)]
    rows += [Case(name, lambda name=name: fetch(name)) for name in ("tcp", "tcp+crc")]
    rows.append(Case("memcpy", lambda: empty_host(data.shape, data.dtype).copy_(data)))
    rows += [Case(name, lambda name=name: fetch(name)) for name in ("shm", "shm+crc")]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="2048,8192", help="prompt lengths, comma-separated")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    element_size = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    layout = KVLayout(
        args.layers, args.block_size, args.kv_heads, args.head_size, args.dtype, element_size
    )
    tokens = [int(t) for t in args.tokens.split(",")]
    context = mp.get_context("spawn")
    found, stop = context.Queue(), context.Event()
    producer = context.Process(
        target=produce, args=(layout, tokens, args.threads, found, stop), daemon=True
    )
    producer.start()
    addresses = found.get(timeout=300)
    conn = socket.create_connection(("127.0.0.1", addresses["socket"]))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    load = os.getloadavg()[0]
    print(
        f"cpu flags: {' '.join(cpu_flags()) or '-'}; nproc {os.cpu_count()}; "
        f"torch threads {args.threads} per process; block {layout.bytes_per_block} bytes ({layout})"
    )
    header = f"{'tokens':>6} {'blocks':>6} {'MB':>7}  {'row':<8} {'GB/s':>6} {'ratio':>6}"
    print(f"{header} {'p50 ms':>8} {'p99 ms':>8}")
    consumers = {kind: transport("127.0.0.1", 0) for kind, transport in TRANSPORTS.items()}
    try:
        for n, data in prompts_of(layout, tokens).items():
            rows = cases(layout, n, data, addresses, conn, consumers)
            for _ in range(args.warmup):
                for row in rows:
                    row.fetch()
            for _ in range(args.iters):  # interleaved: a load spike hits every row alike
                for row in rows:
                    row.time_one()
            report(n, data, rows)
    finally:
        for consumer in consumers.values():
            consumer.close()
        conn.close()
        stop.set()
        producer.join(30)
    print(f"load average {load:.2f} -> {os.getloadavg()[0]:.2f}")


def report(tokens: int, data: torch.Tensor, rows: list[Case]) -> None:
    nbytes = data.numel() * data.element_size()
    baseline = 0.0
    for row in rows:
        p50, p99 = statistics.quantiles(row.seconds, n=100, method="inclusive")[49::49]
        rate = nbytes / p50 / 1e9
        if row.name in ("socket", "memcpy"):
            baseline = rate
        print(
            f"{tokens:>6} {data.shape[0]:>6} {nbytes / 1e6:>7.1f}  {row.name:<8} {rate:>6.2f} "
            f"{rate / baseline:>6.2f} {p50 * 1e3:>8.2f} {p99 * 1e3:>8.2f}"
        )


if __name__ == "__main__":
    main()
