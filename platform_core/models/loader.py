"""Builds a model on its device and fills it from ``*.safetensors`` files (never pickle).

Each checkpoint tensor is read once and copied into its slot: either a whole parameter of the
same name, or one part of a fused linear (``q_proj`` rows of ``qkv_proj``, ...). Any checkpoint
tensor with no slot, any slot left unfilled, or a shape mismatch is a ModelLoadError naming it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from platform_core.errors import ConfigError, ModelLoadError
from platform_core.models.registry import CausalLM, get_model_class
from platform_core.plugins.interfaces import AttentionOps

_INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_from_config(hf_config: Any, requested: str) -> torch.dtype:
    """The dtype to load in: ``requested``, or for ``"auto"`` the config's own dtype when it
    is float32/bfloat16/float16, else float32."""
    if requested != "auto":
        if requested not in _DTYPES:
            raise ConfigError(f"dtype={requested!r} is not supported; valid: {tuple(_DTYPES)}")
        return _DTYPES[requested]
    # transformers 5 names it `dtype` (reading `torch_dtype` there logs a deprecation)
    name = "dtype" if hasattr(hf_config, "dtype") else "torch_dtype"
    declared = getattr(hf_config, name, None)
    if isinstance(declared, torch.dtype):
        return declared if declared in _DTYPES.values() else torch.float32
    return _DTYPES.get(str(declared), torch.float32)


def load_model(
    model_dir: Path,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device,
    attention_ops: AttentionOps,
    op_overrides: dict[str, Callable[..., Any]] | None = None,
) -> CausalLM:
    """Build ``hf_config``'s architecture on ``device`` in ``dtype`` and load its weights."""
    model_cls = get_model_class(hf_config)
    with torch.device(device):
        model = model_cls(hf_config, attention_ops, dtype, op_overrides)
    load_weights(model, Path(model_dir))
    return model.eval()


@dataclass(frozen=True, slots=True)
class _Slot:
    """Rows ``[start, start + length)`` of ``param`` that one checkpoint tensor fills."""

    param: nn.Parameter
    start: int
    length: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.length, *self.param.shape[1:])


def load_weights(model: nn.Module, model_dir: Path) -> None:
    """Copy every checkpoint tensor of ``model_dir`` into ``model``; all or ModelLoadError."""
    slots = _checkpoint_slots(model)
    is_ignored = getattr(model, "is_ignored_weight", lambda _name: False)
    filled: set[str] = set()
    for name, tensor in _read_tensors(model_dir):
        slot = slots.get(name)
        if slot is None:
            if is_ignored(name):
                continue
            raise ModelLoadError(f"unexpected weight {name!r} in {model_dir}")
        if tuple(tensor.shape) != slot.shape:
            raise ModelLoadError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, expected {slot.shape}"
            )
        with torch.no_grad():
            slot.param[slot.start : slot.start + slot.length].copy_(tensor)
        filled.add(name)
    missing = sorted(set(slots) - filled)
    if missing:
        shown = ", ".join(repr(n) for n in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ModelLoadError(f"missing weight(s) in {model_dir}: {shown}{more}")


def _checkpoint_slots(model: nn.Module) -> dict[str, _Slot]:
    """Checkpoint tensor name -> where it goes, from the model's module names and fused parts."""
    slots: dict[str, _Slot] = {}
    for module_name, module in model.named_modules():
        parts = getattr(module, "checkpoint_parts", ())
        sizes = getattr(module, "output_sizes", ())
        for param_name, param in module.named_parameters(recurse=False):
            if not parts:
                slots[f"{module_name}.{param_name}"] = _Slot(param, 0, param.shape[0])
                continue
            parent = module_name.rpartition(".")[0]
            start = 0
            for part, size in zip(parts, sizes, strict=True):
                slots[f"{parent}.{part}.{param_name}".lstrip(".")] = _Slot(param, start, size)
                start += size
    return slots


def _read_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, each read once, in file order (with a progress bar)."""
    files = _safetensors_files(model_dir)
    with tqdm(desc="loading weights", unit="tensor", leave=False, disable=None) as progress:
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                names = list(f.keys())
                progress.total = (progress.total or 0) + len(names)
                for name in names:
                    yield name, f.get_tensor(name)
                    progress.update(1)


def _safetensors_files(model_dir: Path) -> list[Path]:
    """The shard files named by the index, else every ``*.safetensors`` in the directory."""
    index = model_dir / _INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(f"{index} names missing shard file(s): {absent}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(
            p.name for p in model_dir.glob("*.pt*")
        )
        hint = f" (found {others}; pickle checkpoints are never loaded)" if others else ""
        raise ModelLoadError(f"no *.safetensors weights in {model_dir}{hint}")
    return files
