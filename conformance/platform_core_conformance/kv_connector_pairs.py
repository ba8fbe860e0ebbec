"""Driving a KV connector's two sides without engines, for the connector section.

A producer and a consumer, each a connector's scheduler and worker side over a small KV cache
of one backend's layout: the producer's blocks are written through its backend's ``write_kv``,
the consumer loads them through the connector's own protocol (``request_finished`` ->
``remote_tokens`` -> ``blocks_allocated`` -> metadata -> worker), and what lands is compared
through the canonical export.
"""

from __future__ import annotations

import itertools
import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from platform_core.backend_api import Backend
from platform_core.kv_connector_api import (
    BackendKVCache,
    KVConnectorOutput,
    KVConnectorRegistry,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVTransferConfig,
    kv_layout,
)

NUM_LAYERS = 2
KV_HEADS = 2
NUM_BLOCKS = 12
LOAD_TIMEOUT_S = 30.0
_IDS = itertools.count()


@dataclass
class FakeRequest:
    """What a connector reads of a request."""

    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class Side:
    """One instance: a connector's two sides over one backend's cache."""

    backend: Backend
    scheduler: KVConnectorScheduler
    worker: KVConnectorWorker
    cache: BackendKVCache
    finished: KVConnectorOutput = field(default_factory=KVConnectorOutput)

    def step(self) -> KVConnectorOutput:
        """One engine step's connector work (nothing scheduled); accumulates the reports."""
        metadata = self.scheduler.build_metadata()
        self.worker.start_load_kv(metadata)
        self.worker.save_kv(metadata)
        output = self.worker.get_finished()
        self.finished.finished_sending |= output.finished_sending
        self.finished.finished_recving |= output.finished_recving
        for request_id, blocks in output.failed_blocks.items():
            self.finished.failed_blocks.setdefault(request_id, []).extend(blocks)
        return output

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def transfer_config(name: str, role: str, extra_json: str | None) -> KVTransferConfig:
    """The config of one side: a fresh engine id and port, plus the vendor's extra keys."""
    extra = json.loads(extra_json) if extra_json else {}
    return KVTransferConfig.parse(
        {
            "kv_connector": name,
            "kv_role": role,
            "engine_id": f"conformance-{role}-{next(_IDS)}",
            "kv_port": free_port(),
            **extra,
        }
    )


def make_side(
    backend: Backend, config: KVTransferConfig, block_size: int, head_size: int, dtype: torch.dtype
) -> Side:
    """An instance of connector ``config`` over a zeroed cache in ``backend``'s layout."""
    registry = KVConnectorRegistry()
    ops = backend.attention
    shape = ops.kv_cache_shape(NUM_BLOCKS, block_size, KV_HEADS, head_size)
    caches = [torch.zeros(shape, dtype=dtype, device=backend.device) for _ in range(NUM_LAYERS)]
    layout = kv_layout(NUM_LAYERS, block_size, KV_HEADS, head_size, dtype)
    cache = BackendKVCache(ops, caches, layout)
    worker = registry.create_worker(config)
    worker.register_kv_caches(cache)
    return Side(backend, registry.create_scheduler(config, block_size), worker, cache)


def write_tokens(side: Side, block_ids: list[int], num_tokens: int, seed: int) -> None:
    """Random K/V for tokens ``0 .. num_tokens - 1`` of a sequence in ``block_ids``, written
    with the backend's own ``write_kv``."""
    layout = side.cache.layout
    gen = torch.Generator().manual_seed(seed)
    size = layout.block_size
    slots = torch.tensor([block_ids[t // size] * size + t % size for t in range(num_tokens)])
    dtype = side.cache.kv_caches[0].dtype
    for cache in side.cache.kv_caches:
        key, value = (
            torch.randn(num_tokens, KV_HEADS, layout.head_size, generator=gen).to(dtype)
            for _ in range(2)
        )
        device = side.backend.device
        side.backend.attention.write_kv(key.to(device), value.to(device), cache, slots.to(device))


def offer(producer: Side, request: FakeRequest, block_ids: list[int]) -> dict[str, Any]:
    """Finish ``request`` on the producer; its parameters for a consumer (the hold is
    registered by the producer's next step)."""
    finished = producer.scheduler.request_finished(request, block_ids, request.num_tokens)
    assert finished.params is not None, "a do_remote_decode request returned no parameters"
    producer.step()
    return finished.params


def load(producer: Side, consumer: Side, request: FakeRequest, block_ids: list[int]) -> int:
    """Have the consumer load ``request``'s remote blocks into ``block_ids`` (stepping both
    sides until the load ends); the tokens it asked for."""
    remote = consumer.scheduler.remote_tokens(request, 0)
    block_size = consumer.cache.layout.block_size
    blocks = block_ids[: -(-remote.num_tokens // block_size)]  # the last may be partial
    if not blocks:
        return 0
    consumer.scheduler.blocks_allocated(request, blocks, 0)
    deadline = time.monotonic() + LOAD_TIMEOUT_S
    while request.request_id not in consumer.finished.finished_recving:
        assert time.monotonic() < deadline, "the consumer's load never finished"
        consumer.step()
        producer.step()
        time.sleep(0.002)
    return remote.num_tokens
