"""Triton kernel: structured outputs' token bitmask on the logits, for the GPU backends.

One program covers ``WORDS`` bitmask words (``32 * WORDS`` tokens) of one masked row: it loads
the words, spreads each word's bits over a ``[WORDS, 32]`` tile of tokens and stores ``-inf``
where a bit is clear, so the logits are written and never read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

WORDS = 32  # 1024 tokens per program


@triton.jit
def _token_bitmask_kernel(
    logits_ptr,
    bitmask_ptr,
    rows_ptr,
    vocab,
    stride_logits,
    stride_bitmask,
    WORDS: tl.constexpr,
):
    i = tl.program_id(0)
    words = tl.program_id(1) * WORDS + tl.arange(0, WORDS)
    row = tl.load(rows_ptr + i)
    packed = tl.load(bitmask_ptr + i * stride_bitmask + words, mask=words * 32 < vocab, other=-1)
    bits = tl.arange(0, 32)
    tokens = words[:, None] * 32 + bits[None, :]
    banned = ((packed[:, None] >> bits[None, :]) & 1) == 0
    tl.store(
        logits_ptr + row * stride_logits + tokens, float("-inf"), mask=banned & (tokens < vocab)
    )


def triton_apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> None:
    """The GPU backends' ``apply_token_bitmask``
    (:data:`platform_core.layers.token_bitmask.TokenBitmaskFn`); ``bitmask`` and ``rows`` may
    come from the host."""
    count = rows.shape[0]
    if count == 0:
        return
    bitmask = bitmask.to(logits.device, non_blocking=True)
    rows = rows.to(logits.device, non_blocking=True)
    vocab = logits.shape[1]
    grid = (count, triton.cdiv(vocab, 32 * WORDS))
    _token_bitmask_kernel[grid](
        logits, bitmask, rows, vocab, logits.stride(0), bitmask.stride(0), WORDS=WORDS
    )
