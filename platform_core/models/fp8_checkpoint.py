"""Checkpoints stored in FP8: float8 e4m3 weights, each with a float32 ``weight_scale``.

The Hugging Face layout: ``config.json`` declares ``quantization_config: {"quant_method":
"fp8"}``, and a quantized linear ``X`` stores ``X.weight`` as ``float8_e4m3fn [out, in]`` with
``X.weight_scale`` either one for the tensor (shape ``[]`` or ``[1]``) or one per output row
(``[out, 1]`` or ``[out]``): ``w = weight * weight_scale``. A static activation scale
(``X.input_scale``) is read and dropped: activations stay 16/32-bit, only the weights are FP8.
Block-wise scales (``weight_block_size``) are refused. Checkpoints in llm-compressor's
``compressed-tensors`` format with FP8 weights store the same tensors
(:mod:`.fp8_compressed_tensors`), but only in the linears their config quantizes.

With ``quantization="fp8"`` the loader keeps the codes and their scales bit for bit as FP8_E4M3
rows (:mod:`platform_core.quantization.formats`); otherwise it dequantizes them as it reads them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from platform_core.errors import ModelLoadError
from platform_core.models.fp8_compressed_tensors import Fp8Scheme, compressed_fp8_scheme

logger = logging.getLogger("platform_core.models")

SCALE_SUFFIXES = (".weight_scale", ".input_scale")


def stored_fp8(model_dir: Path) -> bool:
    """Whether ``model_dir``'s ``config.json`` declares FP8 weights (a ModelLoadError for
    block-wise FP8 scales and for compressed-tensors schemes other than the FP8 ones loaded);
    logs the activation quantization it declares, computed without."""
    scheme = fp8_scheme(model_dir)
    if scheme is not None and scheme.activations:
        logger.info(
            "%s declares quantized input activations (%s): platform-core computes them "
            "unquantized (16/32-bit), quantizing the weights only",
            model_dir,
            scheme.activations,
        )
    return scheme is not None


def fp8_scheme(model_dir: Path) -> Fp8Scheme | None:
    """Which linears ``model_dir``'s ``config.json`` declares stored in FP8 (None: it declares
    no FP8 weights); a ModelLoadError for block-wise scales and for compressed-tensors
    checkpoints that are not FP8 as :mod:`.fp8_compressed_tensors` loads them."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    quant = config.get("quantization_config") or {}
    method = quant.get("quant_method")
    if method == "compressed-tensors":
        return compressed_fp8_scheme(quant, model_dir)
    if method != "fp8":
        return None
    if quant.get("weight_block_size"):
        raise ModelLoadError(
            f"{model_dir} stores FP8 weights with block-wise scales (weight_block_size "
            f"{quant['weight_block_size']}); platform-core loads one scale per tensor or per "
            "output row"
        )
    return Fp8Scheme(activations=quant.get("activation_scheme"))


def scale_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every ``*.weight_scale`` and ``*.input_scale`` tensor of ``files``, by name (small:
    read before the weights they scale, which the files may list first)."""
    scales = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            stored = f.keys()
            for name in stored:
                if name.endswith(SCALE_SUFFIXES):
                    scales[name] = f.get_tensor(name).float()
    return scales


def row_scales(name: str, scale: torch.Tensor | None, rows: int, selected: slice) -> torch.Tensor:
    """The float32 scales ``[n, 1]`` of the ``selected`` rows of float8 weight ``name`` (of
    ``rows`` rows), from its ``weight_scale``: one for the tensor, or one per row."""
    if scale is None:
        raise ModelLoadError(f"{name!r} is stored as float8 but the checkpoint has no {name}_scale")
    if scale.numel() == 1:
        count = len(range(rows)[selected])
        return scale.reshape(1, 1).expand(count, 1)
    if scale.numel() != rows or scale.dim() > 2 or scale.shape[0] != rows:
        raise ModelLoadError(
            f"{name}_scale has shape {tuple(scale.shape)}: expected one scale, or one per output "
            f"row ({rows}); block-wise scales are not supported"
        )
    return scale.reshape(rows, 1)[selected]
