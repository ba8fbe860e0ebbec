"""bf16 linear on weights pre-packed once into oneDNN's blocked layout.

``F.linear`` on a plain bf16 weight pays per call for preparing the weight for oneDNN; at the
small batches of decode that costs about as much as the matmul (measured: packed is 1.5-2.4x
faster at batch 1-8, equal at 256). :class:`PackedLinear` packs each weight the
first time it is used and reuses the packed copy while the weight is unchanged (same tensor
object, storage and in-place version), so a reloaded weight is packed again. A single
activation row, given a ``gemv`` (the CPU backend's compiled AVX512-BF16 one), skips oneDNN: it
streams weights faster (benchmarks/RESULTS.md: batch-1 decode on SmolLM2, and the 57 MB output
head 2.2 vs 2.8 ms). Other dtypes, and torch builds without oneDNN, take ``F.linear``
unchanged.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Batch size the packed layout is tuned for; any batch size computes correctly with it.
_PACK_BATCH_HINT = 32


def _gemv_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.dim() == 2 and x.shape[0] == 1 and x.stride(-1) == 1 and weight.is_contiguous()


def packed_linear_available() -> bool:
    """Whether this torch build has the oneDNN packed-linear ops."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@dataclass(slots=True)
class _Packed:
    """A packed copy of one weight and what identifies the weight it was packed from."""

    source: weakref.ReferenceType[torch.Tensor]
    data_ptr: int
    version: int
    packed: torch.Tensor


class PackedLinear:
    """``F.linear(x, weight, bias)`` that runs bf16 weights through a cached packed copy.

    The cache holds one packed copy per weight (extra memory equal to the bf16 weights used);
    entries go away with their weight.
    """

    def __init__(self, gemv: Callable[..., torch.Tensor] | None = None) -> None:
        self._cache: dict[int, _Packed] = {}
        self._gemv = gemv

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if weight.dtype != torch.bfloat16 or x.dtype != torch.bfloat16 or weight.requires_grad:
            return F.linear(x, weight, bias)
        if self._gemv is not None and _gemv_fits(x, weight):
            return self._gemv(x, weight, bias)
        packed = self._packed(weight)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    def _packed(self, weight: torch.Tensor) -> torch.Tensor:
        key = id(weight)
        entry = self._cache.get(key)
        if (
            entry is not None
            and entry.source() is weight
            and entry.data_ptr == weight.data_ptr()
            and entry.version == weight._version
        ):
            return entry.packed
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)
        ref = weakref.ref(weight, lambda _ref, k=key: self._forget(k, _ref))
        self._cache[key] = _Packed(ref, weight.data_ptr(), weight._version, packed)
        return packed

    def _forget(self, key: int, ref: weakref.ReferenceType[torch.Tensor]) -> None:
        entry = self._cache.get(key)
        if entry is not None and entry.source is ref:
            del self._cache[key]
