"""The CPU backend's linear: float32 and bf16 weights and activations on the path this CPU has.

- float32 (any CPU with oneDNN): weights packed for oneDNN, as below; 1.2-3x faster than
  ``F.linear`` at the random Llama's shapes, from one row to 512 (benchmarks/RESULTS.md).
- bf16 on CPUs whose oneDNN computes bf16 (AVX-512, AMX, AVX-NE-CONVERT): weights are packed once
  into oneDNN's blocked layout and reused while unchanged (same tensor object, storage and
  in-place version), so a reloaded weight is packed again. ``F.linear`` on a plain bf16 weight pays
  per call for preparing it; at decode's small batches that costs about as much as the matmul
  (measured: packed is 1.5-2.4x faster at batch 1-8, equal at 256). A single activation row goes
  through the compiled GEMV instead, on every level (it streams weights faster: on AVX-512
  without BF16, SmolLM2's batch-1 decode step went from oneDNN's 22-23 ms to 15, RESULTS.md).
- Other CPUs (AVX2): oneDNN raises on bf16 weights there, so every bf16 linear goes through the
  compiled ``linear_bf16``, which keeps the weights bf16 in memory (half the bytes of float32:
  decode reads them all each step) and widens them to fp32 in registers.

Other dtypes, mixed dtypes, and builds without the compiled kernels or oneDNN take ``F.linear``
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


def _rows_fit(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.dim() == 2 and x.stride(-1) == 1 and weight.is_contiguous()


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


class CpuLinear:
    """``F.linear(x, weight, bias)`` on this CPU's best path for the weights' dtype.

    Args:
        kernel: the compiled ``linear_bf16`` (any number of rows), or ``None`` without the
            compiled kernels.
        onednn: oneDNN computes bf16 on this CPU: several rows go to packed weights (one row
            still goes to ``kernel`` where there is one).
        onednn_float32: float32 linears go to packed weights.

    The packed cache holds one copy per weight (extra memory equal to the bf16 weights used);
    entries go away with their weight.
    """

    def __init__(
        self,
        kernel: Callable[..., torch.Tensor] | None,
        *,
        onednn: bool,
        onednn_float32: bool = False,
    ) -> None:
        self._cache: dict[int, _Packed] = {}
        self._kernel = kernel
        self._onednn = onednn
        self._onednn_float32 = onednn_float32

    @property
    def path(self) -> str:
        """Which path bf16 linears take, in words (for the log)."""
        if self._onednn:
            one_row = "; one row: compiled GEMV" if self._kernel is not None else ""
            return f"oneDNN on packed weights{one_row}"
        if self._kernel is not None:
            return "compiled, bf16 weights widened to fp32 in registers"
        return "torch's F.linear"

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if weight.requires_grad or x.dtype != weight.dtype:
            return F.linear(x, weight, bias)
        if weight.dtype == torch.float32 and self._onednn_float32:
            return self._onednn_linear(x, weight, bias)
        if weight.dtype != torch.bfloat16:
            return F.linear(x, weight, bias)
        if self._onednn:
            one_row = x.dim() == 2 and x.shape[0] == 1
            if self._kernel is not None and one_row and _rows_fit(x, weight):
                return self._kernel(x, weight, bias)
            return self._onednn_linear(x, weight, bias)
        if self._kernel is None:
            return F.linear(x, weight, bias)
        rows = x.reshape(-1, x.shape[-1])
        if not _rows_fit(rows, weight):
            rows, weight = rows.contiguous(), weight.contiguous()
        return self._kernel(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])

    def _onednn_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self._packed(weight), bias, "none", [], "")

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
