"""The KV cache as a connector sees it: whole blocks of all layers in the canonical layout."""

from __future__ import annotations

import torch

from platform_core.kv_transfer.interfaces import KVCacheAccess, KVLayout
from platform_core.plugins.interfaces import AttentionOps


class BackendKVCache(KVCacheAccess):
    """Exports and imports blocks ``[n, layers, 2, block_size, kv_heads, head_size]`` through
    the backend's per-layer ``export_blocks`` / ``import_blocks`` (its own layout inside)."""

    def __init__(self, ops: AttentionOps, kv_caches: list[torch.Tensor], layout: KVLayout):
        self.ops = ops
        self.kv_caches = kv_caches
        self.layout = layout
        self.device = kv_caches[0].device

    def _ids(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.int64, device=self.device)

    @torch.inference_mode()
    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        ids = self._ids(block_ids)
        layout = self.layout
        sizes = {"block_size": layout.block_size, "head_size": layout.head_size}
        # [n, layers, 2, ...]: each block's bytes in one piece (what moves and is checksummed)
        out = torch.empty((len(block_ids), *layout.block_shape), dtype=self.kv_caches[0].dtype)
        for layer, cache in enumerate(self.kv_caches):
            keys, values = self.ops.export_blocks(cache, ids, **sizes)
            out[:, layer, 0].copy_(keys)
            out[:, layer, 1].copy_(values)
        return out

    @torch.inference_mode()
    def import_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        if not block_ids:
            return
        ids = self._ids(block_ids)
        blocks = blocks.to(self.device)
        for layer, cache in enumerate(self.kv_caches):
            self.ops.import_blocks(cache, ids, blocks[:, layer].transpose(0, 1))


def kv_layout(
    num_layers: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
) -> KVLayout:
    """The canonical block shape of a cache of these sizes."""
    return KVLayout(
        num_layers=num_layers,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=str(dtype).removeprefix("torch."),
        element_size=torch.empty((), dtype=dtype).element_size(),
    )
