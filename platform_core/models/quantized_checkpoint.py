"""The quantized blocks of a checkpoint, kept beside its 16/32-bit weights.

A model folder materialized from a quantized GGUF holds, besides ``model.safetensors`` (every
tensor dequantized), ``quantized/model.safetensors``: each tensor the GGUF stored quantized, as
``uint8 [rows, row_bytes]`` exactly as stored (:mod:`platform_core.quantization.formats`), under
its Hugging Face name, with the GGML type of each in the file's metadata (``quant_formats``, a
JSON object). Loading with ``quantization="gguf"`` fills the linears from these bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from platform_core.errors import ModelLoadError

QUANTIZED_FILE = Path("quantized") / "model.safetensors"
_FORMATS_KEY = "quant_formats"


def write_quantized_tensors(folder: Path, tensors: dict[str, tuple[np.ndarray, str]]) -> None:
    """Save ``name -> (uint8 [rows, row_bytes], GGML type name)`` under ``folder``."""
    path = folder / QUANTIZED_FILE
    path.parent.mkdir()
    formats = {name: type_name for name, (_, type_name) in tensors.items()}
    # copies: the GGUF's arrays are read-only views of its memory map
    data = {name: torch.from_numpy(np.array(b, dtype=np.uint8)) for name, (b, _) in tensors.items()}
    save_file(data, path, {"format": "pt", _FORMATS_KEY: json.dumps(formats)})


def quantized_formats(model_dir: Path) -> dict[str, str]:
    """The GGML type name of each tensor ``model_dir`` keeps quantized (empty: none)."""
    path = model_dir / QUANTIZED_FILE
    if not path.is_file():
        return {}
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(json.loads((f.metadata() or {})[_FORMATS_KEY]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"cannot read the formats of the blocks in {path}: {exc}") from exc
