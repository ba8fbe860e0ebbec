"""The ops a backend may replace (``Backend.op_overrides``), resolved once at model build.

Names and signatures:

- ``"rms_norm"``: :data:`platform_core.layers.norm.RmsNormFn`
- ``"rotary"``: :data:`platform_core.layers.rotary.RotaryFn`
- ``"silu_and_mul"``: :data:`platform_core.layers.activation.SiluAndMulFn`
- ``"linear"``: :data:`platform_core.layers.linear.LinearFn` (``F.linear``'s signature)
- ``"argmax"``: :data:`platform_core.layers.argmax.ArgmaxFn` (the sampler's row argmax)
- ``"quantized_linear"``: :data:`platform_core.quantization.formats.QuantizedLinearFn` (a
  linear on weights kept in a block format; since plugin API 1.4). The op may name the formats
  it has kernels for in a ``kernel_formats`` attribute (a set of format names; it hands the
  others to the reference op; without one, the GGML block formats), so that the start-up log
  and the automatic choice of ``quantization`` know
  (:func:`platform_core.quantization.formats.has_kernel`).
- ``"apply_token_bitmask"``: :data:`platform_core.layers.token_bitmask.TokenBitmaskFn` (the
  sampler's structured-output mask, in place on float32 logits; since plugin API 1.5)
- ``"lora_shrink"``: :data:`platform_core.layers.lora.LoRAShrinkFn` (each token's input times
  its adapter's A, into a float32 buffer; since plugin API 1.6)
- ``"lora_expand"``: :data:`platform_core.layers.lora.LoRAExpandFn` (the buffer times each
  token's adapter's B, added in place to a projection's output; since plugin API 1.6)
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F

from platform_core.errors import BackendError
from platform_core.layers.activation import SiluAndMulFn, silu_and_mul
from platform_core.layers.argmax import ArgmaxFn, row_argmax
from platform_core.layers.linear import LinearFn
from platform_core.layers.lora import LoRAExpandFn, LoRAShrinkFn, lora_expand, lora_shrink
from platform_core.layers.norm import RmsNormFn, rms_norm
from platform_core.layers.rotary import RotaryFn, apply_rotary
from platform_core.layers.token_bitmask import TokenBitmaskFn, apply_token_bitmask
from platform_core.quantization.formats import QuantizedLinearFn, quantized_linear

OVERRIDABLE_OPS = (
    "rms_norm",
    "rotary",
    "silu_and_mul",
    "linear",
    "argmax",
    "quantized_linear",
    "apply_token_bitmask",
    "lora_shrink",
    "lora_expand",
)


@dataclass(frozen=True, slots=True)
class LayerOps:
    """The op implementations every layer of one model, and its sampler, use."""

    rms_norm: RmsNormFn = rms_norm
    rotary: RotaryFn = apply_rotary
    silu_and_mul: SiluAndMulFn = silu_and_mul
    linear: LinearFn = F.linear
    argmax: ArgmaxFn = row_argmax
    quantized_linear: QuantizedLinearFn = quantized_linear
    apply_token_bitmask: TokenBitmaskFn = apply_token_bitmask
    lora_shrink: LoRAShrinkFn = lora_shrink
    lora_expand: LoRAExpandFn = lora_expand


def resolve_ops(overrides: Mapping[str, Callable[..., Any]] | None) -> LayerOps:
    """Defaults replaced by ``overrides``.

    An unknown name is a ``BackendError`` (a misspelt override would otherwise silently run the
    default op); a backend written for a newer core never gets here, its API version is refused.
    """
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(OVERRIDABLE_OPS))
    if unknown:
        hints = [
            f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name)
            for name in unknown
            for close in [difflib.get_close_matches(name, OVERRIDABLE_OPS, n=1)]
        ]
        raise BackendError(
            f"unknown op override {', '.join(hints)}; overridable ops: {OVERRIDABLE_OPS}"
        )
    return LayerOps(**overrides)
