"""Capture and replay of decode steps as CUDA graphs.

The runner wraps the model's forward (same signature). A decode-only batch whose size fits a
captured bucket is copied into static buffers and replayed; anything else (prefill chunks,
larger batches, other KV caches) runs eagerly. Each graph is captured with a fixed split-KV
count, chosen for the model's full context, so it stays valid as sequences grow.

The returned hidden states of a replay are a view of the graph's static output: they are valid
until the next replay, which is how the model runner consumes them (logits right away).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from platform_core.backend_api import AttentionMetadata, TritonAttentionOps, choose_num_splits
from platform_core_cuda.graph_buckets import DecodeBuffers, bucket_for

logger = logging.getLogger("platform_core_cuda")

Forward = Callable[
    [torch.Tensor, torch.Tensor, list[torch.Tensor], AttentionMetadata], torch.Tensor
]


class CudaGraphRunner:
    """Decode-step graphs for batch sizes ``sizes`` of ``model`` over ``kv_caches``."""

    def __init__(
        self,
        model: Forward,
        kv_caches: list[torch.Tensor],
        attention: TritonAttentionOps,
        sizes: tuple[int, ...],
        max_model_len: int,
        block_size: int,
        num_kv_heads: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.attention = attention
        self.sizes = sizes
        self.max_model_len = max_model_len
        self.num_kv_heads = num_kv_heads
        max_blocks = -(-max_model_len // block_size)
        self.buffers = DecodeBuffers.allocate(max(sizes), max_blocks, block_size, device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so smaller graphs reuse its memory pool."""
        pool = torch.cuda.graph_pool_handle()
        saved = self.attention.num_splits
        try:
            for size in sorted(self.sizes, reverse=True):
                self.attention.num_splits = choose_num_splits(
                    size * self.num_kv_heads, self.max_model_len, self.attention.params
                )
                input_ids, positions, metadata = self.buffers.inputs(size, self.max_model_len)
                self.model(input_ids, positions, self.kv_caches, metadata)  # warm-up: compile
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.model(input_ids, positions, self.kv_caches, metadata)
                self.graphs[size] = (graph, out)
        finally:
            self.attention.num_splits = saved
        logger.info("captured CUDA graphs for decode batch sizes %s", sorted(self.graphs))

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The model's forward: replayed when a captured graph fits, eager otherwise."""
        size = bucket_for(self.sizes, metadata.num_seqs) if metadata.is_decode_only else None
        captured = self.graphs.get(size) if size is not None else None
        if captured is None or kv_caches is not self.kv_caches:
            return self.model(input_ids, positions, kv_caches, metadata)
        graph, out = captured
        self.buffers.fill(input_ids, positions, metadata, size)
        graph.replay()
        self.replays += 1
        return out[: metadata.num_seqs]
