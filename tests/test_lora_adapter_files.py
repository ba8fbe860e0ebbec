"""Reading PEFT LoRA adapters: weights and scaling as PEFT computes them, and every adapter we
cannot serve refused with a ``LoRAAdapterError`` naming the adapter, the file and the problem."""

from __future__ import annotations

import copy
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import build_tiny_model
from lora_utils import ALL_TARGETS, ATTENTION, MLP, make_adapter
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file

from platform_core.errors import LoRAAdapterError
from platform_core.lora.peft_adapter import (
    CONFIG_FILE,
    TARGET_MODULES,
    WEIGHTS_FILE,
    ModuleShape,
    inspect_adapter,
    load_adapter,
    target_shapes,
)
from platform_core.lora_request import LoRARequest

MAX_RANK = 16
_LORA_MODULE = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)$")


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    """Tiny HF models: Llama and Qwen2 with GQA (4 q heads, 2 kv heads), Qwen3 with
    head_dim * heads != hidden_size."""
    return {name: build_tiny_model(name) for name in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="module")
def llama_adapter(models: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid rank-8 adapter of every target module of the tiny Llama (copied, then broken,
    by the refusal tests)."""
    path = tmp_path_factory.mktemp("llama-adapter")
    make_adapter(models["llama"], path, ALL_TARGETS, rank=8, seed=1)
    return path


def _request(path: Path) -> LoRARequest:
    return LoRARequest("my-adapter", 1, str(path))


def _peft_reference(peft_model: Any) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """``(layer, module) -> (lora_A, lora_B * scaling)`` of every PEFT LoRA layer."""
    found = {}
    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer):
            match = _LORA_MODULE.search(name)
            assert match is not None, name
            b = module.lora_B["default"].weight * module.scaling["default"]
            found[int(match[1]), match[2]] = (module.lora_A["default"].weight, b)
    return found


@pytest.mark.parametrize(
    ("model_name", "targets", "rank", "use_rslora"),
    [
        ("llama", ATTENTION, 8, False),
        ("llama", MLP, 16, True),
        ("llama", ALL_TARGETS, 1, False),
        ("qwen2", ALL_TARGETS, 16, True),
        ("qwen2", ATTENTION, 1, True),
        ("qwen2", ("q_proj", "v_proj", "down_proj"), 8, False),
    ],
)
def test_peft_adapters_load_with_peft_weights_and_scaling(
    models: dict[str, Any],
    tmp_path: Path,
    model_name: str,
    targets: tuple[str, ...],
    rank: int,
    use_rslora: bool,
) -> None:
    model = models[model_name]
    peft_model = make_adapter(model, tmp_path, targets, rank, seed=rank, use_rslora=use_rslora)
    request = _request(tmp_path)

    config = inspect_adapter(request, model.config, MAX_RANK)
    adapter = load_adapter(request, model.config, MAX_RANK)

    assert adapter.config == config
    assert (config.rank, config.use_rslora, config.target_modules) == (
        rank,
        use_rslora,
        frozenset(targets),
    )
    assert config.alpha == 2 * rank  # make_adapter's lora_alpha
    reference = _peft_reference(peft_model)
    scalings = {m.scaling["default"] for m in peft_model.modules() if isinstance(m, LoraLayer)}
    assert scalings == {config.scaling}
    assert adapter.weights.keys() == reference.keys()
    assert {module for _, module in reference} == set(targets)
    shapes = target_shapes(model.config)
    for key, (a, b) in adapter.weights.items():
        shape = shapes[key[1]]
        assert a.dtype == b.dtype == torch.float32
        assert a.shape == (rank, shape.in_features) and b.shape == (shape.out_features, rank)
        assert torch.equal(a, reference[key][0]) and torch.equal(b, reference[key][1]), key
    assert adapter.nbytes == 4 * sum(a.numel() + b.numel() for a, b in adapter.weights.values())


def _peft_adapter(model: Any, path: Path, **lora_config: Any) -> Any:
    """Save an adapter of ``model`` with PEFT's own random init; return the PEFT model."""
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=4, init_lora_weights=False, **lora_config)
    peft_model = get_peft_model(copy.deepcopy(model), config)
    peft_model.save_pretrained(path)
    return peft_model


@pytest.mark.parametrize(
    ("lora_config", "modules", "layers"),
    [
        ({"target_modules": r".*\.(q_proj|down_proj)"}, {"q_proj", "down_proj"}, {0, 1}),
        ({"target_modules": "all-linear"}, set(TARGET_MODULES), {0, 1}),
        ({"target_modules": ["k_proj"], "layers_to_transform": [1]}, {"k_proj"}, {1}),
    ],
    ids=["regex", "all-linear", "layers_to_transform"],
)
def test_targets_come_from_the_weights_not_target_modules(
    models: dict[str, Any],
    tmp_path: Path,
    lora_config: dict[str, Any],
    modules: set[str],
    layers: set[int],
) -> None:
    model = models["llama"]
    peft_model = _peft_adapter(model, tmp_path, **lora_config)
    adapter = load_adapter(_request(tmp_path), model.config, MAX_RANK)
    assert adapter.config.target_modules == modules
    assert {layer for layer, _ in adapter.weights} == layers
    reference = _peft_reference(peft_model)
    assert adapter.weights.keys() == reference.keys()
    for key, (a, b) in adapter.weights.items():
        assert torch.equal(a, reference[key][0]) and torch.equal(b, reference[key][1])


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


Tensors = dict[str, torch.Tensor]


def _rewrite_weights(path: Path, edit: Callable[[Tensors], Tensors]) -> None:
    save_file(edit(load_file(path / WEIGHTS_FILE)), path / WEIGHTS_FILE)


def test_adapter_name_segment_and_half_precision_weights(
    models: dict[str, Any], llama_adapter: Path, tmp_path: Path
) -> None:
    model = models["llama"]
    original = load_adapter(_request(llama_adapter), model.config, MAX_RANK)
    path = _copy(llama_adapter, tmp_path / "adapter")
    _rewrite_weights(
        path,
        lambda tensors: {
            re.sub(r"\.lora_([AB])\.weight$", r".lora_\1.default.weight", key): t.bfloat16()
            for key, t in tensors.items()
        },
    )
    adapter = load_adapter(_request(path), model.config, MAX_RANK)
    assert adapter.config == original.config
    assert adapter.weights.keys() == original.weights.keys()
    scaling = adapter.config.scaling
    for key, (a, b) in adapter.weights.items():
        a0, b0 = original.weights[key]
        assert a.dtype == b.dtype == torch.float32
        assert torch.equal(a, a0.bfloat16().float())
        assert torch.equal(b, (b0 / scaling).bfloat16().float() * scaling)


def test_loaded_weights_do_not_map_the_file(
    models: dict[str, Any], llama_adapter: Path, tmp_path: Path
) -> None:
    """Rewriting the file in place (a retrained adapter) leaves loaded weights as they were."""
    path = _copy(llama_adapter, tmp_path / "adapter")
    adapter = load_adapter(_request(path), models["llama"].config, MAX_RANK)
    expected = {key: (a.clone(), b.clone()) for key, (a, b) in adapter.weights.items()}
    with open(path / WEIGHTS_FILE, "r+b") as file:
        data_start = 8 + int.from_bytes(file.read(8), "little")
        size = file.seek(0, 2)
        file.seek(data_start)
        file.write(bytes(size - data_start))
    zeroed = load_adapter(_request(path), models["llama"].config, MAX_RANK)
    assert not any(a.any() for a, _ in zeroed.weights.values())
    for key, (a, b) in adapter.weights.items():
        assert torch.equal(a, expected[key][0]) and torch.equal(b, expected[key][1])


def test_target_shapes_match_the_hf_linear_layers(models: dict[str, Any]) -> None:
    llama = models["llama"].config
    assert llama.num_key_value_heads < llama.num_attention_heads  # GQA: k/v narrower than q
    for model in models.values():
        layer = model.model.layers[0]
        shapes = target_shapes(model.config)
        assert tuple(shapes) == TARGET_MODULES
        for name, shape in shapes.items():
            linear = getattr(layer.mlp if name in MLP else layer.self_attn, name)
            assert shape == ModuleShape(linear.in_features, linear.out_features), name


def _edit_config(**changes: Any) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        data = json.loads((path / CONFIG_FILE).read_text())
        (path / CONFIG_FILE).write_text(json.dumps({**data, **changes}))

    return edit


def _delete(name: str) -> Callable[[Path], None]:
    return lambda path: (path / name).unlink()


def _pickled(name: str) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        torch.save(load_file(path / WEIGHTS_FILE), path / name)
        (path / WEIGHTS_FILE).unlink()

    return edit


def _weights(edit: Callable[[Tensors], Tensors]) -> Callable[[Path], None]:
    return lambda path: _rewrite_weights(path, edit)


def _rename(old: str, new: str) -> Callable[[Tensors], Tensors]:
    return lambda tensors: {key.replace(old, new): t for key, t in tensors.items()}


Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"

# id -> (how the valid adapter is broken, max_rank, the file named ("": the directory), what
# the message says)
REFUSED: dict[str, tuple[Callable[[Path], None], int, str, tuple[str, ...]]] = {
    "no-directory": (shutil.rmtree, MAX_RANK, "", ("not a directory",)),
    "no-config": (_delete(CONFIG_FILE), MAX_RANK, CONFIG_FILE, ("missing",)),
    "config-not-json": (
        lambda path: (path / CONFIG_FILE).write_text("{'r': 8"),
        MAX_RANK,
        CONFIG_FILE,
        ("not valid JSON",),
    ),
    "config-not-an-object": (
        lambda path: (path / CONFIG_FILE).write_text("[8]"),
        MAX_RANK,
        CONFIG_FILE,
        ("not a JSON object",),
    ),
    "not-lora": (_edit_config(peft_type="LOHA"), MAX_RANK, CONFIG_FILE, ("peft_type", "'LOHA'")),
    "no-weights": (_delete(WEIGHTS_FILE), MAX_RANK, WEIGHTS_FILE, ("missing",)),
    "pickle-bin": (
        _pickled("adapter_model.bin"),
        MAX_RANK,
        "adapter_model.bin",
        ("pickled", "only safetensors"),
    ),
    "pickle-pt": (_pickled("adapter_model.pt"), MAX_RANK, "adapter_model.pt", ("safetensors",)),
    "not-safetensors": (
        lambda path: (path / WEIGHTS_FILE).write_bytes(b"\x00" * 64),
        MAX_RANK,
        WEIGHTS_FILE,
        ("not a readable safetensors file",),
    ),
    "rank-above-max": (lambda path: None, 4, CONFIG_FILE, ("r=8", "rank 4", "--max-lora-rank")),
    "c_attn": (
        _weights(_rename("model.layers.0.self_attn.q_proj", "transformer.h.0.attn.c_attn")),
        MAX_RANK,
        WEIGHTS_FILE,
        ("transformer.h.0.attn.c_attn.lora_A.weight", "module 'c_attn'", "not supported"),
    ),
    "layer-out-of-range": (
        _weights(_rename("layers.1.", "layers.2.")),
        MAX_RANK,
        WEIGHTS_FILE,
        ("layers.2.mlp.down_proj.lora_A.weight", "layer 2", "2 layers"),
    ),
    "wrong-place": (
        _weights(_rename("self_attn.q_proj", "mlp.q_proj")),
        MAX_RANK,
        WEIGHTS_FILE,
        ("layers.0.mlp.q_proj.lora_A.weight", "model.layers.<i>.self_attn.q_proj"),
    ),
    "wrong-shape": (
        _weights(lambda tensors: {**tensors, Q_B: torch.zeros(48, 8)}),
        MAX_RANK,
        WEIGHTS_FILE,
        (Q_B, "shape [48, 8]", "expected [64, 8]"),
    ),
    "rank-disagrees-with-config": (
        _edit_config(r=4),
        MAX_RANK,
        WEIGHTS_FILE,
        ("down_proj.lora_A.weight", "shape [8, 128]", "expected [4, 128]", "r=4"),
    ),
    "integer-weights": (
        _weights(lambda tensors: {**tensors, Q_B: tensors[Q_B].to(torch.int32)}),
        MAX_RANK,
        WEIGHTS_FILE,
        (Q_B, "dtype I32"),
    ),
    "no-lora_B": (
        _weights(lambda tensors: {k: t for k, t in tensors.items() if k != Q_B}),
        MAX_RANK,
        WEIGHTS_FILE,
        ("layers.0.self_attn.q_proj.lora_A.weight", "no matching lora_B"),
    ),
    "two-adapters": (
        _weights(
            lambda tensors: {
                **tensors,
                Q_B.replace(".weight", ".other.weight"): tensors[Q_B].clone(),
            }
        ),
        MAX_RANK,
        WEIGHTS_FILE,
        (Q_B, "exactly one adapter"),
    ),
    "dora": (
        _edit_config(use_dora=True),
        MAX_RANK,
        CONFIG_FILE,
        ("use_dora=True is not supported: DoRA",),
    ),
    "bias": (_edit_config(bias="all"), MAX_RANK, CONFIG_FILE, ("bias='all'", "not supported")),
    "lora-bias": (_edit_config(lora_bias=True), MAX_RANK, CONFIG_FILE, ("lora_bias=True",)),
    "fan-in-fan-out": (
        _edit_config(fan_in_fan_out=True),
        MAX_RANK,
        CONFIG_FILE,
        ("fan_in_fan_out=True", "not supported"),
    ),
    "modules-to-save": (
        _edit_config(modules_to_save=["lm_head"]),
        MAX_RANK,
        CONFIG_FILE,
        ("modules_to_save=['lm_head']", "not supported"),
    ),
    "rank-pattern": (
        _edit_config(rank_pattern={"q_proj": 4}),
        MAX_RANK,
        CONFIG_FILE,
        ("rank_pattern=", "not supported: per-module ranks"),
    ),
    "alpha-pattern": (
        _edit_config(alpha_pattern={"q_proj": 4}),
        MAX_RANK,
        CONFIG_FILE,
        ("alpha_pattern=", "not supported: per-module alphas"),
    ),
    "layer-replication": (
        _edit_config(layer_replication=[[0, 2]]),
        MAX_RANK,
        CONFIG_FILE,
        ("layer_replication=[[0, 2]] is not supported",),
    ),
    "trainable-tokens": (
        _edit_config(trainable_token_indices=[5]),
        MAX_RANK,
        CONFIG_FILE,
        ("trainable_token_indices=[5] is not supported: trainable tokens",),
    ),
    "alora": (
        _edit_config(alora_invocation_tokens=[7, 8]),
        MAX_RANK,
        CONFIG_FILE,
        ("alora_invocation_tokens=[7, 8] is not supported",),
    ),
    "no-lora-tensors": (
        _weights(lambda tensors: {}),
        MAX_RANK,
        WEIGHTS_FILE,
        ("holds no LoRA weights",),
    ),
    "full-weights": (
        _weights(lambda tensors: {"base_model.model.lm_head.weight": torch.zeros(256, 64)}),
        MAX_RANK,
        WEIGHTS_FILE,
        ("'base_model.model.lm_head.weight' is not a LoRA weight",),
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_unservable_adapters_are_refused(
    models: dict[str, Any], llama_adapter: Path, tmp_path: Path, case: str
) -> None:
    breaks, max_rank, file_name, fragments = REFUSED[case]
    path = _copy(llama_adapter, tmp_path / "adapter")
    breaks(path)
    request = _request(path)
    for read in (inspect_adapter, load_adapter):
        with pytest.raises(LoRAAdapterError) as raised:
            read(request, models["llama"].config, max_rank)
        message = str(raised.value)
        assert message.startswith(f"LoRA adapter 'my-adapter': {path}"), message
        assert f"{path / file_name}: " in message, message
        for fragment in fragments:
            assert fragment in message, message
        assert raised.value.param == "lora_request"


@pytest.mark.filterwarnings("ignore:Setting `save_embedding_layers`:UserWarning")
@pytest.mark.parametrize(
    ("targets", "fragments"),
    [
        (["embed_tokens", "q_proj"], ("embed_tokens.lora_embedding_A", "'embed_tokens'")),
        (["lm_head"], ("lm_head.lora_A.weight", "module 'lm_head'")),
    ],
    ids=["embed_tokens", "lm_head"],
)
def test_peft_adapters_of_modules_the_model_cannot_serve_are_refused(
    models: dict[str, Any], tmp_path: Path, targets: list[str], fragments: tuple[str, ...]
) -> None:
    make_adapter(models["llama"], tmp_path, targets, rank=4, seed=0)
    with pytest.raises(LoRAAdapterError) as raised:
        inspect_adapter(_request(tmp_path), models["llama"].config, MAX_RANK)
    message = str(raised.value)
    assert f"{tmp_path / WEIGHTS_FILE}: " in message
    for fragment in (*fragments, "not supported"):
        assert fragment in message, message


def test_an_adapter_for_another_model_is_refused(
    models: dict[str, Any], llama_adapter: Path
) -> None:
    """The Llama adapter's k/v projections (2 kv heads of 16) do not fit Qwen3's (of 32)."""
    match = r"k_proj\.lora_B\.weight' has shape \[32, 8\], expected \[64, 8\]"
    with pytest.raises(LoRAAdapterError, match=match):
        inspect_adapter(_request(llama_adapter), models["qwen3"].config, MAX_RANK)
