"""Builds a model on its device and fills it from ``*.safetensors`` files (never pickle).

Each checkpoint tensor has one slot: the parameter it fills and its placement there (a whole
parameter of the same name, one part of a fused linear such as the ``q_proj`` rows of
``qkv_proj``, and under tensor parallelism only this rank's rows or columns). Only the slot's
part of the tensor is read from the file, after checking the tensor's full shape. Any checkpoint
tensor with no slot, any slot left unfilled, or a shape mismatch is a ModelLoadError naming it.
With ``quantization="gguf"`` the weights that keep their blocks (:mod:`.quantized_weights`) are
filled from ``quantized/model.safetensors`` instead of the dequantized tensors of the same names;
a quantized weight read from 16/32-bit tensors (``"int8"``, ``"int4"``, ``"fp8"``) is quantized
as it is read, this rank's part only (an FP8 column shard reads its rows whole: each row's scale
is the whole row's). Float8 weights with their scales (:mod:`.fp8_checkpoint`) are kept as stored
in FP8 layers and dequantized as they are read into any other; with ``"fp8"`` the linears an FP8
checkpoint stores 16/32-bit (a compressed-tensors ``ignore`` list) stay 16/32-bit.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from platform_core.distributed.parallel_state import TPGroup
from platform_core.errors import ConfigError, ModelLoadError
from platform_core.layers.sharding import Placement, Shard, whole_placement
from platform_core.models.checkpoint_names import checkpoint_names
from platform_core.models.fp8_checkpoint import fp8_scheme, row_scales, scale_tensors
from platform_core.models.quantized_checkpoint import QUANTIZED_FILE, quantized_formats
from platform_core.models.quantized_weights import (
    LOAD_TIME_FORMATS,
    keep_weights_quantized,
    load_time_formats,
    log_reference_formats,
)
from platform_core.models.registry import CausalLM, get_model_class
from platform_core.plugins.interfaces import AttentionOps
from platform_core.quantization.formats import QuantFormat, fp8_rows, quantize

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
    tp: TPGroup | None = None,
    quantization: str | None = None,
) -> CausalLM:
    """Build ``hf_config``'s architecture on ``device`` in ``dtype`` and load its weights; with
    ``quantization="gguf"`` the layers keep the checkpoint's blocks where they can (logged).

    With a ``tp`` group of several ranks, builds and loads this rank's shard only.
    """
    model_cls = get_model_class(hf_config)
    with torch.device(device):
        model = model_cls(hf_config, attention_ops, dtype, op_overrides, tp)
    blocks: frozenset[str] = frozenset()
    if quantization == "gguf":
        formats = quantized_formats(Path(model_dir))
        if not formats:
            raise ModelLoadError(
                f"quantization='gguf' needs a quantized GGUF checkpoint; {model_dir} keeps no "
                "quantized tensors"
            )
        blocks = frozenset(keep_weights_quantized(model, formats).kept)
    elif quantization in LOAD_TIME_FORMATS:
        formats = load_time_formats(model, quantization)
        scheme = fp8_scheme(Path(model_dir)) if quantization == "fp8" else None
        if scheme is not None:  # the linears an FP8 checkpoint stores 16/32-bit stay so
            formats = {name: fmt for name, fmt in formats.items() if scheme.quantizes(name)}
        keep_weights_quantized(model, formats, quantization)
    if quantization not in (None, "none"):
        op = (op_overrides or {}).get("quantized_linear")
        log_reference_formats(model, op, quantization)
    load_weights(model, Path(model_dir), blocks)
    return model.eval()


@dataclass(frozen=True, slots=True)
class _Slot:
    """The parameter one checkpoint tensor fills, and which part of the tensor goes where."""

    param: nn.Parameter
    placement: Placement
    #: the block format of a quantized parameter
    quant: QuantFormat | None = None

    def read(self, name: str, handle: Any, scale: torch.Tensor | None = None) -> torch.Tensor:
        """This slot's part of the checkpoint tensor ``name``, after checking its full shape;
        for a quantized parameter, blocks (quantized here from 16/32-bit values, which the
        checkpoint indexes by column where the parameter indexes by byte). A float8 tensor
        (with its ``weight_scale``, ``scale``) fills an FP8_E4M3 parameter as stored, and any
        other dequantized."""
        placement, fmt = self.placement, self.quant
        expected = placement.checkpoint_shape(self.param)
        stored = handle.get_dtype()
        if fmt is not None and stored != "U8":  # values or float8 codes, indexed by column
            expected = (expected[0], fmt.in_features(expected[1]))
            if placement.dim == 1:
                source = placement.source
                columns = Shard(*(fmt.in_features(n) for n in astuple(source)))
                placement = Placement(1, columns, placement.dst_start)
        shape = tuple(handle.get_shape())
        if shape != expected:
            raise ModelLoadError(f"weight {name!r} has shape {shape}, expected {expected}")
        if stored == "F8_E4M3":
            return self._from_float8(name, handle, placement, scale)
        if fmt is None or stored == "U8":
            return handle[placement.source_index()]
        columns = slice(None)
        if fmt.scale_bytes and placement.dim == 1:  # the row's scale is the whole row's
            source = placement.source
            columns = slice(source.start, source.start + source.length)
            placement = Placement(1, Shard.whole(source.full))
        try:
            return quantize(handle[placement.source_index()], fmt, columns)
        except ValueError as exc:
            raise ModelLoadError(f"cannot quantize {name!r} to {fmt.name}: {exc}") from exc

    def _from_float8(
        self, name: str, handle: Any, placement: Placement, scale: torch.Tensor | None
    ) -> torch.Tensor:
        index = placement.source_index()
        rows = index[0] if placement.dim == 0 else slice(None)
        scales = row_scales(name, scale, handle.get_shape()[0], rows)
        codes = handle[index]
        if self.quant is not None and self.quant.scale_bytes:
            return fp8_rows(codes, scales)
        values = codes.float() * scales
        return values if self.quant is None else quantize(values, self.quant)


def load_weights(
    model: nn.Module, model_dir: Path, quantized: frozenset[str] = frozenset()
) -> None:
    """Copy every checkpoint tensor of ``model_dir`` into ``model``; all or ModelLoadError. The
    ``quantized`` names come from the quantized blocks file, not from the 16/32-bit weights."""
    slots = _checkpoint_slots(model)
    is_ignored = getattr(model, "is_ignored_weight", lambda _name: False)
    filled: set[str] = set()
    files = _safetensors_files(model_dir)
    scales = scale_tensors(files)  # of float8 weights (none in a 16/32-bit checkpoint)
    tensors = _tensors(files, skip=quantized | scales.keys())
    if quantized:
        tensors = itertools.chain(tensors, _tensors([model_dir / QUANTIZED_FILE], only=quantized))
    for name, handle in tensors:
        slot = slots.get(name)
        if slot is None:
            if is_ignored(name):
                continue
            raise ModelLoadError(f"unexpected weight {name!r} in {model_dir}")
        with torch.no_grad():
            part = slot.read(name, handle, scales.get(f"{name}_scale"))
            slot.placement.destination(slot.param).copy_(part)
        filled.add(name)
    missing = sorted(set(slots) - filled)
    if missing:
        shown = ", ".join(repr(n) for n in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ModelLoadError(f"missing weight(s) in {model_dir}: {shown}{more}")


def _checkpoint_slots(model: nn.Module) -> dict[str, _Slot]:
    """Checkpoint tensor name -> its slot, from the model's module names, fused parts and the
    placements sharded layers declare."""
    slots: dict[str, _Slot] = {}
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            placements = (
                module.placements(param_name)
                if hasattr(module, "placements")
                else (whole_placement(param),)
            )
            names = checkpoint_names(module_name, module, param_name)
            quant = getattr(module, "quant", None) if param_name == "weight" else None
            for name, placement in zip(names, placements, strict=True):
                slots[name] = _Slot(param, placement, quant)
    return slots


def _tensors(
    files: list[Path], skip: frozenset[str] = frozenset(), only: frozenset[str] | None = None
) -> Iterator[tuple[str, Any]]:
    """A lazy slice handle of every tensor of ``files`` (less ``skip``; only ``only`` if set),
    in file order, with a progress bar.

    A handle reads nothing until indexed; its ``get_shape()`` is the full shape.
    """
    with tqdm(desc="loading weights", unit="tensor", leave=False, disable=None) as progress:
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                stored = f.keys()
                names = [n for n in stored if n not in skip and (only is None or n in only)]
                progress.total = (progress.total or 0) + len(names)
                for name in names:
                    yield name, f.get_slice(name)
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
