"""The socket KV transports (``tcp``, ``shm``) between a producer serving a fake ``BlockSource``
and a consumer: exact round trips, refusals and errors as the connector expects them, concurrent
fetches, and nothing left behind (threads, sockets, shared-memory segments) after ``close``,
also when a consumer dies mid-way. Then a producer in another process (``shm``) and on another
"host" (``tcp`` between two network namespaces)."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from multiprocessing.synchronize import Event
from pathlib import Path

import pytest
import torch
from netns import host_pair, in_namespace

from platform_core.kv_transfer import shm_transport
from platform_core.kv_transfer.framing import Reply, Request, recv_message, send_message
from platform_core.kv_transfer.interfaces import KVLayout
from platform_core.kv_transfer.shm_transport import SEGMENT_PREFIX, ShmTransport
from platform_core.kv_transfer.tcp_transport import TcpTransport
from platform_core.kv_transfer.transport import (
    BlockBatch,
    BlockTransport,
    TransferError,
    UnknownTransferError,
)

BF16 = KVLayout(2, 4, 2, 8, "bfloat16", 2)
F32 = KVLayout(3, 16, 1, 32, "float32", 4)
TRANSFER = "req-1"


class FakeSource:
    """``num_blocks`` random blocks held under ``TRANSFER``; positions past them are missing.
    ``fail_next``: the next read raises; ``gate``: reads wait for it."""

    def __init__(self, layout: KVLayout, num_blocks: int = 6, seed: int = 0):
        self.layout = layout
        generator = torch.Generator().manual_seed(seed)
        shape = (num_blocks, *layout.block_shape)
        self.blocks = torch.randn(shape, generator=generator).to(getattr(torch, layout.dtype))
        self.confirmed: list[str] = []
        self.fail_next = False
        self.gate: threading.Event | None = None

    def read(self, transfer_id: str, positions: list[int]) -> BlockBatch:
        if self.gate is not None:
            self.gate.wait()
        if self.fail_next:
            self.fail_next = False
            raise ValueError("the disk is on fire")
        if transfer_id != TRANSFER:
            raise UnknownTransferError(f"no KV blocks are held for {transfer_id!r}")
        return self.expected(positions)

    def expected(self, positions: list[int]) -> BlockBatch:
        held = range(len(self.blocks))
        rows = torch.zeros((len(positions), *self.layout.block_shape), dtype=self.blocks.dtype)
        for row, position in enumerate(positions):
            if position in held:
                rows[row] = self.blocks[position]
        checksums = [zlib.crc32(row.view(-1).view(torch.uint8).numpy()) for row in rows]
        return BlockBatch(rows, checksums, [i for i, p in enumerate(positions) if p not in held])

    def confirm(self, transfer_id: str) -> None:
        self.confirmed.append(transfer_id)


def segments(pid: int | None = None) -> list[str]:
    """Names of the shared-memory segments producers in process ``pid`` (this one) made."""
    return sorted(p.name for p in Path("/dev/shm").glob(f"{SEGMENT_PREFIX}{pid or os.getpid()}_*"))


def wait_until(condition: Callable[[], bool], timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def assert_same(batch: BlockBatch, expected: BlockBatch) -> None:
    assert batch.data.dtype == expected.data.dtype
    assert batch.data.shape == expected.data.shape
    assert batch.data.is_contiguous()
    assert torch.equal(batch.data.view(torch.uint8), expected.data.view(torch.uint8))
    assert batch.checksums == expected.checksums
    assert batch.missing == expected.missing


Make = Callable[..., BlockTransport]


@pytest.fixture(autouse=True)
def nothing_left_behind() -> Iterator[None]:
    threads = set(threading.enumerate())
    yield
    assert wait_until(lambda: set(threading.enumerate()) <= threads, 2.0), threading.enumerate()
    assert segments() == []


@pytest.fixture(params=["tcp", "shm"])
def make(request: pytest.FixtureRequest) -> Iterator[Make]:
    """Makes transports of the kind under test (closed afterwards); keywords as theirs."""
    made: list[BlockTransport] = []

    def make_(**options: float) -> BlockTransport:
        if request.param == "tcp":
            transport: BlockTransport = TcpTransport("127.0.0.1", 0, **options)
        else:
            transport = ShmTransport(**options)
        made.append(transport)
        return transport

    yield make_
    for transport in made:
        transport.close()


def serving(make: Make, source: FakeSource) -> tuple[BlockTransport, dict]:
    """A producer serving ``source``, and its address."""
    producer = make()
    producer.serve(source)
    return producer, producer.address()


@pytest.mark.parametrize("layout", [BF16, F32], ids=["bf16", "f32"])
def test_a_fetch_carries_blocks_checksums_and_missing_exactly(make: Make, layout: KVLayout):
    source = FakeSource(layout)
    _, address = serving(make, source)
    consumer = make()
    for positions in ([4, 0, 9, 2], [], [5], [3, 3, 1, 0, 2, 4, 5, 7]):
        batch = consumer.fetch(address, TRANSFER, positions, layout)
        assert_same(batch, source.expected(positions))


def test_a_bigger_fetch_after_a_smaller_one_on_the_same_connection(
    make: Make, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(shm_transport, "CHUNK_BYTES", 1000)  # many chunks, across blocks
    source = FakeSource(BF16, num_blocks=64)
    _, address = serving(make, source)
    consumer = make()
    for positions in ([1], list(range(64))[::-1], [2, 3]):
        assert_same(consumer.fetch(address, TRANSFER, positions, BF16), source.expected(positions))


def test_a_fetch_of_megabytes(make: Make):
    layout = KVLayout(4, 16, 4, 64, "bfloat16", 2)  # 64 KiB a block: 10 MiB, received on its
    source = FakeSource(layout, num_blocks=160)  # own mapping (huge pages), two shm chunks
    _, address = serving(make, source)
    positions = list(range(160))[::-1]
    assert_same(make().fetch(address, TRANSFER, positions, layout), source.expected(positions))


def test_blocks_of_another_shape_are_refused_another_dtype_is_not(make: Make):
    _, address = serving(make, FakeSource(BF16))
    consumer = make()
    other = KVLayout(2, 4, 2, 16, "bfloat16", 2)
    with pytest.raises(TransferError, match="blocks here are") as caught:
        consumer.fetch(address, TRANSFER, [0], other)
    assert not isinstance(caught.value, UnknownTransferError)
    batch = consumer.fetch(address, TRANSFER, [0], KVLayout(2, 4, 2, 8, "float32", 4))
    assert batch.data.dtype == torch.bfloat16  # the producer's; the connector converts


def test_an_unknown_transfer_id_is_an_unknown_transfer_error(make: Make):
    _, address = serving(make, FakeSource(BF16))
    with pytest.raises(UnknownTransferError, match="no KV blocks are held for 'gone'"):
        make().fetch(address, "gone", [0], BF16)


def test_a_failing_read_is_a_transfer_error_and_the_producer_serves_on(make: Make):
    source = FakeSource(BF16)
    _, address = serving(make, source)
    consumer = make()
    source.fail_next = True
    with pytest.raises(TransferError, match="the disk is on fire") as caught:
        consumer.fetch(address, TRANSFER, [0, 1], BF16)
    assert not isinstance(caught.value, UnknownTransferError)
    assert_same(consumer.fetch(address, TRANSFER, [1, 0], BF16), source.expected([1, 0]))


def test_a_closed_producer_fails_fetches_quickly_and_names_its_address(make: Make):
    producer, address = serving(make, FakeSource(BF16))
    consumer = make(connect_timeout_s=30.0, io_timeout_s=30.0)
    consumer.fetch(address, TRANSFER, [0], BF16)  # leaves an idle connection in the pool
    producer.close()
    where = f"127.0.0.1:{address['port']}"
    for client in (consumer, make()):
        started = time.monotonic()
        with pytest.raises(TransferError, match=where):
            client.fetch(address, TRANSFER, [0], BF16)
        with pytest.raises(TransferError, match=where):
            client.confirm(address, TRANSFER)
        assert time.monotonic() - started < 2.0


def test_a_stalled_producer_times_out(make: Make):
    source = FakeSource(BF16)
    source.gate = threading.Event()
    _, address = serving(make, source)
    started = time.monotonic()
    try:
        with pytest.raises(TransferError, match="timed out"):
            make(io_timeout_s=0.3).fetch(address, TRANSFER, [0], BF16)
    finally:
        source.gate.set()
    assert time.monotonic() - started < 2.0


def test_concurrent_fetches_from_many_threads(make: Make):
    source = FakeSource(BF16, num_blocks=32)
    _, address = serving(make, source)
    consumer = make()

    def fetch(seed: int) -> None:
        positions = torch.randperm(40, generator=torch.Generator().manual_seed(seed))[:12]
        positions = positions.tolist()
        for _ in range(4):
            batch = consumer.fetch(address, TRANSFER, positions, BF16)
            assert_same(batch, source.expected(positions))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(fetch, range(8)))


def test_confirm_reaches_the_source(make: Make):
    source = FakeSource(BF16)
    _, address = serving(make, source)
    consumer = make()
    consumer.confirm(address, TRANSFER)
    consumer.confirm(address, "never-held")
    assert source.confirmed == [TRANSFER, "never-held"]


def test_a_garbled_request_drops_that_connection_only(make: Make):
    source = FakeSource(BF16)
    _, address = serving(make, source)
    with socket.create_connection((address["host"], address["port"])) as raw:
        raw.sendall(b"\x00\x00\x00\x05hello")
        raw.settimeout(2.0)
        assert raw.recv(1) == b""  # the producer hung up
    assert_same(make().fetch(address, TRANSFER, [2], BF16), source.expected([2]))


def test_close_leaves_no_thread_socket_or_segment(make: Make):
    fds = len(os.listdir("/proc/self/fd"))
    threads = set(threading.enumerate())
    producer, address = serving(make, FakeSource(BF16))
    consumer = make()
    consumer.fetch(address, TRANSFER, [0, 1], BF16)
    producer.close()
    consumer.close()
    assert set(threading.enumerate()) == threads
    assert len(os.listdir("/proc/self/fd")) <= fds
    assert segments() == []
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((address["host"], address["port"]), timeout=1).close()
    producer.close()  # twice is harmless


def test_the_address_advertises_the_given_host():
    transport = TcpTransport("127.0.0.1", 0, advertise_host="kv-producer.example")
    with pytest.raises(TransferError, match="serves nothing yet"):
        transport.address()
    transport.serve(FakeSource(BF16))
    try:
        address = transport.address()
        assert address["host"] == "kv-producer.example" and address["port"] > 0
    finally:
        transport.close()


# ---------------------------------------------------------------------- shared-memory segments
def raw_fetch(address: dict, positions: list[int]) -> tuple[socket.socket, Reply]:
    """A consumer that asks for blocks and then does nothing more."""
    conn = socket.create_connection((address["host"], address["port"]), timeout=5)
    send_message(conn, Request("fetch", TRANSFER, positions, BF16))
    reply = recv_message(conn, Reply)
    assert reply is not None and reply.segment
    return conn, reply


def test_a_segment_is_reused_between_fetches_then_unlinked_when_idle():
    producer = ShmTransport(keep_segment_s=0.3)
    consumer = ShmTransport()
    try:
        producer.serve(FakeSource(BF16))
        for _ in range(3):
            consumer.fetch(producer.address(), TRANSFER, [0, 1, 2], BF16)
            assert len(segments()) == 1
        assert wait_until(lambda: segments() == [])
    finally:
        consumer.close()
        producer.close()


def test_a_segment_is_unlinked_when_its_consumer_dies_or_stalls():
    producer = ShmTransport(io_timeout_s=0.3)
    try:
        producer.serve(FakeSource(BF16))
        conn, reply = raw_fetch(producer.address(), [0, 1])
        assert segments() == [reply.segment]
        conn.close()  # died before releasing it
        assert wait_until(lambda: segments() == [])
        conn, reply = raw_fetch(producer.address(), [0, 1])
        assert segments() == [reply.segment]
        assert wait_until(lambda: segments() == [])  # silent past io_timeout_s
        conn.close()
    finally:
        producer.close()


def test_close_unlinks_a_segment_in_use():
    producer = ShmTransport()
    producer.serve(FakeSource(BF16))
    conn, reply = raw_fetch(producer.address(), [0])
    assert segments() == [reply.segment]
    producer.close()
    assert segments() == []
    conn.close()


def serve_in_child(layout: KVLayout, seed: int, ready: mp.Queue, stop: Event) -> None:
    producer = ShmTransport()
    producer.serve(FakeSource(layout, seed=seed))
    ready.put((os.getpid(), producer.address()))
    stop.wait(60)
    producer.close()
    ready.put(segments())


def test_a_producer_in_another_process():
    context = mp.get_context("spawn")
    ready, stop = context.Queue(), context.Event()
    child = context.Process(target=serve_in_child, args=(F32, 7, ready, stop), daemon=True)
    child.start()
    consumer = ShmTransport()
    try:
        pid, address = ready.get(timeout=60)
        expected = FakeSource(F32, seed=7)
        for positions in ([5, 0, 2, 8], [1]):
            batch = consumer.fetch(address, TRANSFER, positions, F32)
            assert_same(batch, expected.expected(positions))
        consumer.confirm(address, TRANSFER)
        stop.set()
        assert ready.get(timeout=30) == []
        child.join(30)
        assert child.exitcode == 0
        assert segments(pid) == []
    finally:
        consumer.close()
        if child.is_alive():
            child.terminate()


# ---------------------------------------------------------------------- across "hosts"
PRODUCER = """
import sys
sys.path.insert(0, "tests")
from test_kv_transports import BF16, FakeSource
from platform_core.kv_transfer.tcp_transport import TcpTransport
producer = TcpTransport(sys.argv[1], 0)
producer.serve(FakeSource(BF16, seed=3))
print(producer.address()["port"], flush=True)
sys.stdin.read()
producer.close()
"""

CONSUMER = """
import sys
sys.path.insert(0, "tests")
from test_kv_transports import BF16, TRANSFER, FakeSource, assert_same
from platform_core.kv_transfer.tcp_transport import TcpTransport
consumer = TcpTransport("0.0.0.0", 0)
address = {"host": sys.argv[1], "port": int(sys.argv[2])}
positions = [4, 1, 7, 0]
expected = FakeSource(BF16, seed=3).expected(positions)
assert_same(consumer.fetch(address, TRANSFER, positions, BF16), expected)
consumer.confirm(address, TRANSFER)
consumer.close()
print("fetched")
"""


def test_tcp_between_two_network_namespaces():
    root = Path(__file__).resolve().parents[1]
    python = partial(subprocess.Popen, cwd=root, text=True, stdout=subprocess.PIPE)
    with host_pair("kv", 233) as pair:
        producer = python(
            in_namespace(pair.first, sys.executable, "-c", PRODUCER, pair.first_ip),
            stdin=subprocess.PIPE,
        )
        try:
            port = producer.stdout.readline().strip()
            assert port.isdigit(), "the producer did not start"
            consumer = subprocess.run(
                in_namespace(pair.second, sys.executable, "-c", CONSUMER, pair.first_ip, port),
                cwd=root,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert consumer.stdout.strip() == "fetched", consumer.stderr
        finally:
            producer.communicate("", timeout=30)
        assert producer.returncode == 0
