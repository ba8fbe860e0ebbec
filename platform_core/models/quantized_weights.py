"""Which weights of a built model keep their checkpoint's quantized blocks, and why others do not.

With ``quantization="gguf"`` every linear, and the token embedding (the output head too, tied to
it or not), whose checkpoint tensors are all stored in one block format that the
``quantized_linear`` op computes on (:data:`QUANT_FORMATS`) keeps its weight in that format; the
loader then fills it from ``quantized/model.safetensors``. A fused projection whose parts were
stored in different formats runs dequantized (one weight holds one format), logged. A weight
stored in a block format we cannot compute on is refused, naming the format.

With ``"int8"`` / ``"int4"`` the loader quantizes 16/32-bit weights as it reads them
(:func:`load_time_formats`): linears to Q8_0 / Q4_1, the embedding and output head to Q8_0 in
both (8 bits keep the logits close; they are a large share of a small model's bytes). A weight
whose rows (or this rank's share of them) are not whole blocks of 32 stays 16/32-bit, logged.
With ``"fp8"`` the linears become FP8_E4M3 (a float32 scale per output row, any shape); the
embedding and output head stay 16/32-bit, as in the FP8 checkpoints other engines serve.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from torch import nn

from platform_core.errors import ModelLoadError
from platform_core.layers.linear import QuantizableLinear, QuantizableWeight
from platform_core.models.checkpoint_names import checkpoint_names
from platform_core.quantization.formats import (
    ALL_QUANT_FORMATS,
    QUANT_FORMATS,
    QuantizedLinearFn,
    has_kernel,
)

logger = logging.getLogger("platform_core.models")


@dataclass
class QuantizedWeights:
    """The outcome: checkpoint names now loaded as blocks, and what was dequantized and why."""

    kept: dict[str, str] = field(default_factory=dict)  # checkpoint name -> format
    dequantized: dict[str, str] = field(default_factory=dict)  # checkpoint name -> why


def quantized_layers(model: nn.Module) -> list[QuantizableWeight]:
    """The model's layers that keep a quantized weight."""
    return [m for m in model.modules() if isinstance(m, QuantizableWeight) and m.quant]


def quantized_summary(model: nn.Module) -> str | None:
    """``"quantized Q4_1 x 120, Q8_0 x 1"`` (each fused layer counted once), or None."""
    counts = Counter(m.quant.name for m in quantized_layers(model) if m.quant)
    if not counts:
        return None
    return "quantized " + ", ".join(f"{f} x {n}" for f, n in sorted(counts.items()))


def log_reference_formats(model: nn.Module, op: QuantizedLinearFn | None, mode: str) -> None:
    """Log each format the model keeps that the backend's ``quantized_linear`` ``op`` (None: it
    has none) has no kernel for: those layers run the core's reference op."""
    formats = {m.quant.name: m.quant for m in quantized_layers(model) if m.quant}
    why = "the backend has no quantized_linear op" if op is None else "no backend kernel for it"
    for name, fmt in sorted(formats.items()):
        if not has_kernel(op, fmt):
            logger.info(
                "quantization %s: the %s layers run the core's reference op (dequantize, then "
                "matmul, on every call): %s",
                mode,
                name,
                why,
            )


# mode -> the linears' format; and the embedding's and output head's (none: 16/32-bit)
LOAD_TIME_FORMATS = {"int8": "Q8_0", "int4": "Q4_1", "fp8": "FP8_E4M3"}
_TABLE_FORMATS = {"int8": "Q8_0", "int4": "Q8_0"}
_UNQUANTIZED = "16/32-bit"  # a fused part stored so, beside quantized ones


def load_time_formats(model: nn.Module, mode: str) -> dict[str, str]:
    """Checkpoint name -> format for quantizing at load time (``mode`` int8, int4 or fp8)."""
    formats = {}
    for module_name, module in model.named_modules():
        if isinstance(module, QuantizableWeight):
            linear = isinstance(module, QuantizableLinear)
            fmt = LOAD_TIME_FORMATS[mode] if linear else _TABLE_FORMATS.get(mode)
            if fmt is not None:
                names = checkpoint_names(module_name, module, "weight")
                formats.update(dict.fromkeys(names, fmt))
    return formats


def keep_weights_quantized(
    model: nn.Module, formats: dict[str, str], mode: str = "gguf"
) -> QuantizedWeights:
    """Switch every layer whose checkpoint tensors are all ``formats`` of one supported block
    format to that format (``formats``: checkpoint name -> GGML type name), and log the outcome.
    With ``mode`` "gguf" a layer that cannot hold its blocks is an error; quantizing at load
    time it stays 16/32-bit."""
    outcome = QuantizedWeights()
    for module_name, module in model.named_modules():
        if not isinstance(module, QuantizableWeight):
            continue
        names = checkpoint_names(module_name, module, "weight")
        stored = {formats.get(name) for name in names}
        if stored == {None}:
            continue  # stored 16/32-bit
        if len(stored) > 1:
            shown = sorted(str(fmt or _UNQUANTIZED) for fmt in stored)
            why = f"its parts are stored in different formats ({shown})"
            outcome.dequantized.update(dict.fromkeys(names, why))
            continue
        (type_name,) = stored
        fmt = (QUANT_FORMATS if mode == "gguf" else ALL_QUANT_FORMATS).get(str(type_name))
        if fmt is None:
            raise ModelLoadError(
                f"{names[0]} is stored as GGUF type {type_name}, which platform-core does not "
                f"compute on quantized (supported: {', '.join(QUANT_FORMATS)}); pass "
                "quantization='none' (or a dtype) to run the model dequantized"
            )
        try:
            module.keep_quantized(fmt)
        except ValueError as exc:
            if mode == "gguf":
                raise ModelLoadError(f"cannot keep {module_name} quantized: {exc}") from exc
            outcome.dequantized.update(dict.fromkeys(names, str(exc)))
            continue
        outcome.kept.update(dict.fromkeys(names, fmt.name))
    for name in sorted(set(formats) - set(outcome.kept) - set(outcome.dequantized)):
        outcome.dequantized[name] = "no layer of the model computes on it quantized"
    for name, why in sorted(outcome.dequantized.items()):
        logger.info(
            "quantization %s: %s (%s) is not kept quantized: %s",
            mode,
            name,
            formats.get(name, _UNQUANTIZED),
            why,
        )
    logger.info(
        "quantization %s: %s; %d tensor(s) not kept quantized",
        mode,
        quantized_summary(model) or "no weight kept quantized",
        len(outcome.dequantized),
    )
    return outcome
