"""Vocabulary-parallel token table: the input embedding and the (tied or own) output head.

Each rank holds a contiguous range of vocabulary rows; the vocabulary is padded up to a multiple
of the tensor-parallel size, and the padding rows are zero and never loaded. The table may be
kept quantized (``keep_quantized``): looked-up rows are dequantized, and the output head runs
the ``quantized_linear`` op on the blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from platform_core.distributed.parallel_state import TPGroup
from platform_core.layers.linear import LinearFn, QuantizableWeight
from platform_core.layers.sharding import Placement, Shard
from platform_core.quantization.formats import QuantizedLinearFn, dequantize, quantized_linear


class VocabParallelEmbedding(QuantizableWeight):
    """A ``[vocab, hidden]`` table split by vocabulary rows over the ranks of ``tp``.

    ``forward`` looks ids up (each rank contributes the rows it holds, then an all-reduce);
    ``logits`` uses the table as the output projection (local logits, then an all-gather).
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        tp: TPGroup,
        linear: LinearFn = F.linear,
        quantized: QuantizedLinearFn = quantized_linear,
    ) -> None:
        super().__init__()
        self.dtype = dtype
        start, length, padded = tp.padded_shard_range(vocab_size)
        self.vocab_size = vocab_size
        self.shard = Shard(start, length, vocab_size)
        self.weight = nn.Parameter(
            torch.empty(padded, hidden_size, dtype=dtype), requires_grad=False
        )
        with torch.no_grad():
            self.weight[length:].zero_()
        self._communicator = tp.communicator if tp.is_parallel else None
        self._linear = linear
        self._quantized_linear = quantized

    def placements(self, param_name: str) -> tuple[Placement, ...]:
        """This rank's vocabulary rows fill the start of the table."""
        return (Placement(0, self.shard),)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` ids -> ``[T, hidden]`` embeddings (the full rows, on every rank)."""
        if self._communicator is None:
            return self._rows(input_ids)
        local = input_ids - self.shard.start
        elsewhere = (local < 0) | (local >= self.shard.length)
        rows = self._rows(local.masked_fill(elsewhere, 0))
        rows.masked_fill_(elsewhere.unsqueeze(-1), 0)
        return self._communicator.all_reduce(rows)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is None:
            return F.embedding(ids, self.weight)
        return dequantize(self.weight.index_select(0, ids), self.quant, self.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden] -> [N, vocab]`` over the full vocabulary in the model's dtype, on every
        rank (the sampler widens to float32 only what it computes with: a greedy row's argmax
        reads the model's dtype as it is)."""
        if self.quant is None:
            logits = self._linear(hidden, self.weight, None)
        else:
            logits = self._quantized_linear(hidden, self.weight, self.quant, None)
        if self._communicator is not None:
            logits = self._communicator.all_gather(logits, dim=-1)[..., : self.vocab_size]
        return logits

    def extra_repr(self) -> str:
        shard = self.shard
        rows = f"{shard.start}:{shard.start + shard.length} of {shard.full}"
        return f"vocab={rows}{self._quant_repr()}"
