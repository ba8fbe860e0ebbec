"""KV connector: blocks moved by a connector between the backend under test and every installed
backend (itself included), in both directions, land exactly; an injected failure is reported as
failed blocks, never as garbage in the cache.

The connector is ``--kv-connector NAME`` (default ``loopback``, the in-process one: the check
then certifies the backend's block export and import through a real connector's protocol);
``--kv-connector-config JSON`` adds keys to its ``kv_transfer_config`` (a vendor's extra config).
"""

from __future__ import annotations

import pytest
import torch

from platform_core.backend_api import Backend, PluginManager
from platform_core_conformance.batches import TORCH_DTYPES
from platform_core_conformance.context import create_backend
from platform_core_conformance.kv_connector_pairs import (
    FakeRequest,
    load,
    make_side,
    offer,
    transfer_config,
    write_tokens,
)

PRODUCER_BLOCKS = [5, 2, 9, 0, 7]
CONSUMER_BLOCKS = [3, 8, 1, 10, 6]


def _available() -> list[str]:
    return sorted(row.name for row in PluginManager().probe() if row.available)


@pytest.fixture(scope="module")
def peers() -> dict[str, Backend]:
    return {}


def _peer(peers: dict[str, Backend], name: str) -> Backend:
    if name not in peers:
        peers[name] = create_backend(name)[1]
    return peers[name]


def _common(a: Backend, b: Backend) -> tuple[torch.dtype, int, int]:
    ca, cb = a.capabilities, b.capabilities
    dtypes = [d for d in ca.dtypes if d in cb.dtypes]
    blocks = sorted(set(ca.block_sizes) & set(cb.block_sizes))
    heads = sorted(set(ca.head_sizes) & set(cb.head_sizes))
    if not (dtypes and blocks and heads):
        pytest.skip(f"{a.name} and {b.name} share no dtype, block size or head size")
    block = 16 if 16 in blocks else blocks[0]
    head = 64 if 64 in heads else heads[0]
    return TORCH_DTYPES[dtypes[0]], block, head


def _pair(context, peers, peer: str, direction: str, option):
    under_test = context.backend
    other = _peer(peers, peer)
    producer_backend, consumer_backend = (
        (under_test, other) if direction == "sends" else (other, under_test)
    )
    dtype, block, head = _common(producer_backend, consumer_backend)
    name, extra = option("kv_connector") or "loopback", option("kv_connector_config")
    producer = make_side(
        producer_backend, transfer_config(name, "kv_producer", extra), block, head, dtype
    )
    consumer = make_side(
        consumer_backend, transfer_config(name, "kv_consumer", extra), block, head, dtype
    )
    return producer, consumer, block


@pytest.mark.parametrize("direction", ["sends", "receives"])
@pytest.mark.parametrize("peer", _available())
def test_kv_connector_moves_blocks_exactly(conformance, peers, peer, direction, request):
    producer, consumer, block = _pair(conformance, peers, peer, direction, request.config.getoption)
    try:
        num_tokens = 4 * block + 3  # all but the last token move: the fifth block partly
        write_tokens(producer, PRODUCER_BLOCKS, num_tokens, seed=11)
        prompt = list(range(num_tokens))
        params = offer(
            producer,
            FakeRequest("conformance-1", prompt, {"do_remote_decode": True}),
            PRODUCER_BLOCKS,
        )
        loaded = load(
            producer, consumer, FakeRequest("consumer-1", prompt, params), CONSUMER_BLOCKS
        )
        assert loaded == num_tokens - 1
        assert not consumer.finished.failed_blocks, consumer.finished.failed_blocks
        sent = producer.cache.export_blocks(PRODUCER_BLOCKS)
        landed = consumer.cache.export_blocks(CONSUMER_BLOCKS)
        assert torch.equal(landed, sent), "loaded blocks differ from the producer's"
        untouched = consumer.cache.export_blocks([0, 2, 4])
        assert not untouched.any(), "the load wrote blocks it was not given"
        assert "conformance-1" in producer.finished.finished_sending
    finally:
        producer.close()
        consumer.close()


@pytest.mark.parametrize("fault", ["released", "producer_gone"])
def test_kv_connector_reports_a_failed_load(conformance, peers, fault, request):
    producer, consumer, block = _pair(
        conformance, peers, conformance.name, "sends", request.config.getoption
    )
    try:
        num_tokens = 3 * block + 1
        write_tokens(producer, PRODUCER_BLOCKS, num_tokens, seed=12)
        prompt = list(range(num_tokens))
        params = offer(
            producer,
            FakeRequest("conformance-2", prompt, {"do_remote_decode": True}),
            PRODUCER_BLOCKS,
        )
        if fault == "released":  # the hold timed out before the consumer came
            producer.scheduler.release("conformance-2", "timeout")
            producer.step()
        else:
            producer.worker.shutdown()
        request_id = "consumer-2"
        load(producer, consumer, FakeRequest(request_id, prompt, params), CONSUMER_BLOCKS)
        failed = consumer.finished.failed_blocks.get(request_id, [])
        assert sorted(failed) == sorted(CONSUMER_BLOCKS[:3]), failed
        assert not consumer.cache.export_blocks(CONSUMER_BLOCKS[:3]).any(), "garbage imported"
    finally:
        if fault != "producer_gone":
            producer.close()
        else:
            producer.scheduler.shutdown()
        consumer.close()
