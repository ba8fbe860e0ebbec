"""FP8 checkpoints in llm-compressor's ``compressed-tensors`` format, mapped onto the FP8 path.

``quantization_config: {"quant_method": "compressed-tensors", ...}`` quantizes the layers each
of its ``config_groups`` targets (``"Linear"``, a module name, or ``re:`` and a regular
expression matched at the start of the name) but those ``ignore`` names, which stay 16/32-bit.
With FP8 weights (``weights: {num_bits: 8, type: "float", symmetric: true}``) and the format
``float-quantized`` or ``naive-quantized`` (the same layout: compressed-tensors' float
compressor is its naive one under another name) a quantized linear ``X`` stores ``X.weight`` as
float8 e4m3 with ``X.weight_scale`` of shape ``[1]`` (strategy ``tensor``) or ``[out, 1]``
(``channel``), as the ``quant_method: fp8`` layout does. Quantized input activations (dynamic,
or static with ``X.input_scale``) are computed unquantized; anything else is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from platform_core.errors import ModelLoadError

FP8_FORMATS = ("float-quantized", "naive-quantized")
FP8_STRATEGIES = ("tensor", "channel")
# config keys for what platform-core does not load, whenever set
_UNSUPPORTED = {
    "sparsity_config": "sparse weights",
    "kv_cache_scheme": "a quantized KV cache",
    "transform_config": "transformed (rotated) weights",
}


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """Which linears a checkpoint stores in FP8, named as compressed-tensors names them (the
    ``quant_method: fp8`` layout's default: every linear), and the input-activation
    quantization it declares (None: none), which platform-core computes without."""

    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ()
    activations: str | None = None

    def quantizes(self, weight: str) -> bool:
        """Whether the linear weight ``weight`` (``model.layers.0.mlp.down_proj.weight``) is
        stored in FP8."""
        module = weight.removesuffix(".weight")
        targeted = any(_names(target, module) for target in self.targets)
        return targeted and not any(_names(target, module) for target in self.ignore)


def compressed_fp8_scheme(quant: dict[str, Any], model_dir: Path) -> Fp8Scheme:
    """The FP8 scheme of a compressed-tensors ``quantization_config``; a ModelLoadError naming
    what it declares that is not FP8 weights with a scale per tensor or per output channel."""
    for key, what in _UNSUPPORTED.items():
        declared = quant.get(key)
        # A "dense" sparsity config (older llm-compressor releases write one) stores the
        # weights as they are: nothing to do for it.
        if key == "sparsity_config" and isinstance(declared, dict):
            declared = declared.get("format", "dense") != "dense"
        if declared:
            raise _refused(model_dir, f"{what} ({key})")
    groups = quant.get("config_groups") or {}
    if not groups:
        raise _refused(model_dir, "no config_groups")
    targets: list[str] = []
    activations: set[str] = set()
    for name, group in groups.items():
        problem = _group_problem(group, quant.get("format"))
        if problem:
            raise _refused(model_dir, f"config group {name!r}: {problem}")
        targets += group.get("targets") or ()
        if group.get("input_activations"):
            activations.add(_describe(group["input_activations"]))
    return Fp8Scheme(
        tuple(targets), tuple(quant.get("ignore") or ()), ", ".join(sorted(activations)) or None
    )


def _group_problem(group: Any, default_format: str | None) -> str | None:
    """What a config group declares beyond FP8 weights, if anything."""
    if not isinstance(group, dict):
        return f"{group!r} is not a quantization scheme"
    weights = group.get("weights")
    if not weights:
        return "no weight quantization (activations only)"
    kind = f"{weights.get('num_bits')}-bit {weights.get('type')}"
    if kind != "8-bit float":
        return f"{kind} weights"
    if weights.get("strategy") not in FP8_STRATEGIES:
        return f"weight strategy {weights.get('strategy')!r}"
    if not weights.get("symmetric", True):
        return "asymmetric weights (zero points)"
    fmt = group.get("format") or default_format  # per group in "mixed-precision" checkpoints
    if fmt not in FP8_FORMATS:
        return f"format {fmt!r}"
    if group.get("output_activations"):
        return "quantized output activations"
    return None


def _describe(args: dict[str, Any]) -> str:
    """``"8-bit float, dynamic, per token"``: quantization arguments in words."""
    words = [f"{args.get('num_bits')}-bit {args.get('type')}"]
    words.append("dynamic" if args.get("dynamic") else "static")
    if args.get("strategy"):
        words.append(f"per {args['strategy']}")
    return ", ".join(words)


def _names(target: str, module: str) -> bool:
    """Whether the ``targets``/``ignore`` entry ``target`` names the linear ``module``."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target in ("Linear", module)


def _refused(model_dir: Path, problem: str) -> ModelLoadError:
    """The error for a compressed-tensors checkpoint with ``problem``."""
    return ModelLoadError(
        f"{model_dir} is a compressed-tensors checkpoint with {problem}; platform-core loads "
        "compressed-tensors checkpoints of FP8 weights only (8-bit float, symmetric, one scale "
        f"per tensor or per output channel: strategy {' or '.join(FP8_STRATEGIES)}; format "
        f"{' or '.join(FP8_FORMATS)})"
    )
