"""Reading PEFT LoRA adapters (``adapter_config.json`` + ``adapter_model.safetensors``) and
checking they fit the served model; every adapter we cannot serve exactly is refused with a
``LoRAAdapterError`` that names the adapter, the file and the problem."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from platform_core.errors import LoRAAdapterError
from platform_core.lora_request import LoRARequest
from platform_core.models.decoder_spec import DecoderSpec

TARGET_MODULES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
_FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})
_MLP = frozenset({"gate_proj", "up_proj", "down_proj"})
# where a target module's LoRA weights live: [base_model.model.]model.layers.<i>.<group>
_LOCATION = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)")

# adapter_config.json keys that change what the adapter computes in ways we do not implement
# when set to anything but one of _OFF: key -> the unsupported feature
_UNSUPPORTED: dict[str, str] = {
    "use_dora": "DoRA",
    "bias": "training the base model's biases",
    "lora_bias": "LoRA biases",
    "fan_in_fan_out": "the Conv1D weight layout",
    "modules_to_save": "fully trained modules",
    "rank_pattern": "per-module ranks",
    "alpha_pattern": "per-module alphas",
    "layer_replication": "layer replication",
    "target_parameters": "LoRA on parameters",
    "trainable_token_indices": "trainable tokens",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
}
_OFF: tuple[Any, ...] = (None, False, "none", [], {})


@dataclass(frozen=True, slots=True)
class ModuleShape:
    """An ``nn.Linear``'s full (unsharded) sizes."""

    in_features: int
    out_features: int


def target_shapes(hf_config: Any) -> dict[str, ModuleShape]:
    """The full shape of each of ``TARGET_MODULES`` in one decoder layer of the model."""
    spec = DecoderSpec.from_hf(hf_config)
    hidden, inter = spec.hidden_size, spec.intermediate_size
    q_rows, kv_rows = spec.num_heads * spec.head_size, spec.num_kv_heads * spec.head_size
    return {
        "q_proj": ModuleShape(hidden, q_rows),
        "k_proj": ModuleShape(hidden, kv_rows),
        "v_proj": ModuleShape(hidden, kv_rows),
        "o_proj": ModuleShape(q_rows, hidden),
        "gate_proj": ModuleShape(hidden, inter),
        "up_proj": ModuleShape(hidden, inter),
        "down_proj": ModuleShape(inter, hidden),
    }


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """What serving an adapter needs to know before reading its weights."""

    rank: int
    alpha: float
    use_rslora: bool
    target_modules: frozenset[str]

    @property
    def scaling(self) -> float:
        """The factor PEFT multiplies ``B @ A`` by (rsLoRA: ``alpha / sqrt(rank)``)."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """An adapter's weights: ``(layer, module) -> (A [r, in], B [out, r] * scaling)``, float32
    on the CPU."""

    request: LoRARequest
    config: AdapterConfig
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        """Host memory the weights take."""
        return sum(t.numel() * t.element_size() for pair in self.weights.values() for t in pair)


def inspect_adapter(request: LoRARequest, hf_config: Any, max_rank: int) -> AdapterConfig:
    """Check the adapter against the model and ``max_rank`` from its config and the weights'
    header only (no tensor data); ``LoRAAdapterError`` if it cannot be served."""
    config, weights = _paths(request)
    with _open(request, weights) as handle:
        adapter_config, _ = _check(request, hf_config, max_rank, config, weights, handle)
    return adapter_config


def load_adapter(request: LoRARequest, hf_config: Any, max_rank: int) -> LoRAAdapter:
    """Check the adapter (as ``inspect_adapter``), then read its weights: float32, CPU, B
    scaled."""
    config, weights = _paths(request)
    with _open(request, weights) as handle:
        adapter_config, keys = _check(request, hf_config, max_rank, config, weights, handle)
        scaling = adapter_config.scaling
        # copies: the handle's tensors map the file, which may be rewritten while we hold them
        loaded = {
            target: (
                handle.get_tensor(key_a).to(torch.float32, copy=True),
                handle.get_tensor(key_b).to(torch.float32) * scaling,
            )
            for target, (key_a, key_b) in keys.items()
        }
    return LoRAAdapter(request, adapter_config, loaded)


def _fail(request: LoRARequest, path: Path, problem: str) -> LoRAAdapterError:
    return LoRAAdapterError(
        f"LoRA adapter {request.lora_name!r}: {path}: {problem}", "lora_request"
    )


def _paths(request: LoRARequest) -> tuple[Path, Path]:
    """The adapter's config and weights files, refusing a missing one or pickled weights."""
    root = Path(request.lora_path)
    if not root.is_dir():
        raise _fail(request, root, "not a directory (a local PEFT adapter directory is needed)")
    config, weights = root / CONFIG_FILE, root / WEIGHTS_FILE
    if not config.is_file():
        raise _fail(request, config, f"missing; not a PEFT adapter directory (no {CONFIG_FILE})")
    if not weights.is_file():
        pickled = [name for name in _PICKLE_FILES if (root / name).is_file()]
        if pickled:
            raise _fail(
                request,
                root / pickled[0],
                f"pickled weights are not loaded, only safetensors; convert the adapter to "
                f"{WEIGHTS_FILE} (e.g. save_pretrained(..., safe_serialization=True))",
            )
        raise _fail(request, weights, "missing")
    return config, weights


def _open(request: LoRARequest, weights: Path) -> Any:
    try:
        return safe_open(str(weights), framework="pt", device="cpu")
    except (SafetensorError, OSError) as err:
        raise _fail(request, weights, f"not a readable safetensors file ({err})") from err


def _read_config(request: LoRARequest, path: Path) -> tuple[int, float, bool]:
    """``(r, lora_alpha, use_rslora)`` from ``adapter_config.json``, refusing anything but a
    plain LoRA (missing keys take PEFT's defaults)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _fail(request, path, f"not valid JSON ({err})") from err
    if not isinstance(data, dict):
        raise _fail(request, path, "not a JSON object")
    if data.get("peft_type") != "LORA":
        raise _fail(request, path, f"peft_type is {data.get('peft_type')!r}; only 'LORA' is served")
    for key, what in _UNSUPPORTED.items():
        value = data.get(key)
        if value not in _OFF:
            raise _fail(request, path, f"{key}={value!r} is not supported: {what}")
    rank, alpha, rslora = data.get("r", 8), data.get("lora_alpha", 8), data.get("use_rslora", False)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise _fail(request, path, f"r={rank!r} is not a positive integer")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise _fail(request, path, f"lora_alpha={alpha!r} is not a number")
    if not isinstance(rslora, bool):
        raise _fail(request, path, f"use_rslora={rslora!r} is not a boolean")
    return rank, float(alpha), rslora


def _check(
    request: LoRARequest,
    hf_config: Any,
    max_rank: int,
    config_path: Path,
    weights_path: Path,
    handle: Any,
) -> tuple[AdapterConfig, dict[tuple[int, str], tuple[str, str]]]:
    """The adapter's config and ``(layer, module) -> (A key, B key)``, from the config and the
    weights' header; the modules are the ones the weights hold, whatever target_modules says."""
    rank, alpha, use_rslora = _read_config(request, config_path)
    if rank > max_rank:
        raise _fail(
            request,
            config_path,
            f"rank r={rank} is above the engine's maximum LoRA rank {max_rank} "
            "(start the engine with a larger --max-lora-rank)",
        )
    shapes = target_shapes(hf_config)
    num_layers = int(hf_config.num_hidden_layers)
    found: dict[tuple[int, str], dict[str, str]] = {}
    # LoRA tensors first, so an adapter of unsupported modules is refused for those, not for
    # the full weights PEFT saves along with some of them (embeddings)
    for key in sorted(handle.keys(), key=lambda key: (".lora_" not in key, key)):
        layer, module, side = _parse_key(request, weights_path, key, num_layers)
        sides = found.setdefault((layer, module), {})
        if side in sides:
            raise _fail(
                request,
                weights_path,
                f"tensors {sides[side]!r} and {key!r} are both lora_{side} of layer {layer} "
                f"{module}; the file must hold exactly one adapter",
            )
        sides[side] = key
        shape = shapes[module]
        expected = [rank, shape.in_features] if side == "A" else [shape.out_features, rank]
        view = handle.get_slice(key)
        if list(view.get_shape()) != expected:
            raise _fail(
                request,
                weights_path,
                f"tensor {key!r} has shape {list(view.get_shape())}, expected {expected} "
                f"(r={rank}, {module} of this model is {shape.in_features} -> "
                f"{shape.out_features})",
            )
        if view.get_dtype() not in _FLOAT_DTYPES:
            raise _fail(
                request, weights_path, f"tensor {key!r} has dtype {view.get_dtype()}, not a float"
            )
    if not found:
        raise _fail(request, weights_path, "holds no LoRA weights (no lora_A / lora_B tensors)")
    pairs = {}
    for target, sides in found.items():
        if len(sides) == 1:
            ((side, key),) = sides.items()
            other = "B" if side == "A" else "A"
            raise _fail(request, weights_path, f"tensor {key!r} has no matching lora_{other}")
        pairs[target] = (sides["A"], sides["B"])
    modules = frozenset(module for _, module in pairs)
    return AdapterConfig(rank, alpha, use_rslora, modules), pairs


def _parse_key(request: LoRARequest, path: Path, key: str, num_layers: int) -> tuple[int, str, str]:
    """``(layer, module, "A" or "B")`` of a PEFT tensor name such as
    ``base_model.model.model.layers.3.self_attn.q_proj.lora_A[.<adapter name>].weight``."""
    parts = key.split(".")
    index = next((i for i, part in enumerate(parts) if part.startswith("lora_")), None)
    if index is None:
        raise _fail(
            request,
            path,
            f"tensor {key!r} is not a LoRA weight (fully trained modules are not supported)",
        )
    kind, rest = parts[index], parts[index + 1 :]
    module = parts[index - 1] if index else ""
    if kind.startswith("lora_embedding"):
        raise _fail(
            request, path, f"tensor {key!r}: LoRA on the embedding {module!r} is not supported"
        )
    if kind == "lora_magnitude_vector":
        raise _fail(request, path, f"tensor {key!r}: DoRA is not supported")
    if kind not in ("lora_A", "lora_B") or rest[-1:] != ["weight"] or len(rest) > 2:
        raise _fail(request, path, f"tensor {key!r} is not a LoRA A or B weight")
    if module not in TARGET_MODULES:
        raise _fail(
            request,
            path,
            f"tensor {key!r}: LoRA on module {module!r} is not supported; the model's "
            f"LoRA targets are {', '.join(TARGET_MODULES)}",
        )
    group = "mlp" if module in _MLP else "self_attn"
    location = _LOCATION.fullmatch(".".join(parts[: index - 1]))
    if location is None or location[2] != group:
        raise _fail(request, path, f"tensor {key!r} is not under model.layers.<i>.{group}.{module}")
    layer = int(location[1])
    if layer >= num_layers:
        raise _fail(
            request,
            path,
            f"tensor {key!r} is for layer {layer}, but the model has {num_layers} layers",
        )
    return layer, module, kind[-1]
