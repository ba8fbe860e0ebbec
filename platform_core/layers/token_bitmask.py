"""Token bitmask: structured outputs' grammar mask on the logits, an op a backend may override
(``"apply_token_bitmask"``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

TokenBitmaskFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
"""``apply_token_bitmask(logits, bitmask, rows) -> None``, in place.

``logits`` is float32 ``[R, V]``, ``bitmask`` int32 ``[N, W]`` with ``W >= ceil(V / 32)``,
``rows`` int64 ``[N]``, all contiguous. Token ``t`` is allowed in row ``rows[i]`` when bit
``t % 32`` of ``bitmask[i, t // 32]`` is set, bits counted from the least significant (the
packing of xgrammar's ``allocate_token_bitmask`` and ``fill_next_token_bitmask``); every token
not allowed gets ``-inf``. Bits for tokens ``t >= V`` are ignored, rows not in ``rows`` (which
are distinct) are left as they are, and ``N`` may be 0. The sampler widens the logits to
float32 before the call. Everything is on the backend's device, except that a GPU backend may
get ``bitmask`` and ``rows`` on the CPU and moves them itself."""

_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Default token-bitmask op (:data:`TokenBitmaskFn`): the bits unpacked with torch shifts,
    all masked rows at once."""
    if rows.numel() == 0:
        return
    device = logits.device
    rows = rows.to(device)
    shifts = _BIT_SHIFTS.to(device)
    # [N, W, 32] bits, then one flag per token; an arithmetic shift of a negative word still
    # leaves its bit in place.
    bits = (bitmask.to(device).unsqueeze(-1) >> shifts) & 1
    banned = bits.flatten(1)[:, : logits.shape[1]] == 0
    logits[rows] = logits[rows].masked_fill_(banned, float("-inf"))
