"""FP8 checkpoints in llm-compressor's compressed-tensors format (issue #25): float8 weights
with a scale per tensor or per channel run as the same weights stored ``quant_method: fp8``
do, the linears of the ``ignore`` list stay 16/32-bit, quantized input activations are
computed unquantized (logged), and every other compressed-tensors scheme is refused, naming
why."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from quantized_models import (
    LINEARS_PER_MODEL,
    assert_same,
    copy_config,
    fp8_exact_copy,
    generate,
    write_fp8_checkpoint,
)
from safetensors.torch import load_file

from platform_core import LLM
from platform_core.errors import ModelLoadError
from platform_core.models.fp8_compressed_tensors import compressed_fp8_scheme

COMMON = {"backend": "template", "dtype": "float32", "quantization": "fp8"}
HF_FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic"}
DYNAMIC = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
STATIC = {**DYNAMIC, "strategy": "tensor", "dynamic": False}


def _weights(strategy: str = "channel", **args) -> dict:
    """Weight quantization arguments: FP8 with ``strategy`` unless ``args`` say otherwise."""
    return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, **args}


def _config(
    weights: dict | None = None,
    input_activations: dict | None = None,
    output_activations: dict | None = None,
    fmt: str = "float-quantized",
    ignore: tuple[str, ...] = ("lm_head",),
    **extra,
) -> dict:
    """A compressed-tensors ``quantization_config`` as llm-compressor writes one: a group over
    every linear (FP8 per channel unless ``weights`` say otherwise), ``extra`` keys added."""
    group = {
        "targets": ["Linear"],
        "weights": _weights() if weights is None else weights,
        "input_activations": input_activations,
        "output_activations": output_activations,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        **extra,
    }


def _kept_weights(runner) -> dict[str, torch.Tensor]:
    """The weights of the layers ``runner``'s model keeps quantized, by layer name."""
    layers = runner.model.named_modules()
    return {name: m.weight for name, m in layers if getattr(m, "quant", None) is not None}


@pytest.mark.parametrize(
    ("strategy", "activations", "fmt"),
    [("tensor", STATIC, "float-quantized"), ("channel", DYNAMIC, "naive-quantized")],
)
def test_compressed_fp8_runs_as_the_same_weights_stored_quant_method_fp8(
    tiny_model_dir, tmp_path, caplog, strategy, activations, fmt
):
    model_dir = tiny_model_dir("llama")
    config = _config(_weights(strategy), activations, fmt=fmt)
    static = activations is STATIC

    def per_tensor(_name: str) -> bool:
        return strategy == "tensor"

    stored = write_fp8_checkpoint(
        model_dir, tmp_path / "ct", config, per_tensor, tensor_scale_shape=(1,), input_scale=static
    )
    reference = write_fp8_checkpoint(model_dir, tmp_path / "fp8", HF_FP8, per_tensor)
    with caplog.at_level(logging.INFO, logger="platform_core.models"):
        outputs, runner = generate(stored, **COMMON)
    timing = "static" if static else "dynamic"
    assert f"(8-bit float, {timing}, per {activations['strategy']}): " in caplog.text
    assert "computes them unquantized" in caplog.text
    theirs, their_runner = generate(reference, **COMMON)
    assert runner.quantization == f"quantized FP8_E4M3 x {LINEARS_PER_MODEL}"
    ours, kept = _kept_weights(runner), _kept_weights(their_runner)
    assert ours.keys() == kept.keys()
    for name, weight in ours.items():
        assert torch.equal(weight, kept[name]), name
    assert_same(outputs, theirs, atol=0)


def test_the_ignored_linears_stay_unquantized(tiny_model_dir, tmp_path, caplog):
    """Ignored: one linear by a regular expression, and one part of a fused projection by its
    name (the fused layer runs dequantized); the reference stores the same linears 16/32-bit,
    FP8-exact so that its quantizing them at load time loses nothing."""
    exact = fp8_exact_copy(tiny_model_dir("llama"), tmp_path / "exact")
    ignore = ("lm_head", r"re:.*\.0\.mlp\.down_proj$", "model.layers.1.self_attn.q_proj")
    dense_names = ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight")

    def dense(name: str) -> bool:
        return name in dense_names

    args = {"per_tensor": lambda _name: False, "dense": dense}
    config = _config(ignore=ignore)
    stored = write_fp8_checkpoint(exact, tmp_path / "ct", config, input_scale=False, **args)
    reference = write_fp8_checkpoint(exact, tmp_path / "fp8", HF_FP8, **args)
    with caplog.at_level(logging.INFO, logger="platform_core.models"):
        outputs, runner = generate(stored, **COMMON)
    # layer 0's down_proj, and layer 1's fused q/k/v
    assert runner.quantization == f"quantized FP8_E4M3 x {LINEARS_PER_MODEL - 2}"
    assert "stored in different formats (['16/32-bit', 'FP8_E4M3'])" in caplog.text
    layers = dict(runner.model.named_modules())
    down = layers["model.layers.0.mlp.down_proj"]
    assert down.quant is None
    assert torch.equal(down.weight, load_file(exact / "model.safetensors")[dense_names[0]])
    assert layers["model.layers.1.self_attn.qkv_proj"].quant is None
    assert layers["model.layers.1.mlp.down_proj"].quant is not None
    theirs, their_runner = generate(reference, **COMMON)
    assert their_runner.quantization == f"quantized FP8_E4M3 x {LINEARS_PER_MODEL}"
    assert_same(outputs, theirs)


@pytest.mark.parametrize(
    ("config", "refusal"),
    [
        (_config(_weights(type="int"), fmt="int-quantized"), "8-bit int weights"),
        (
            _config(
                _weights("group", num_bits=4, type="int", group_size=128), fmt="pack-quantized"
            ),
            "4-bit int weights",
        ),
        (
            _config(
                _weights("tensor_group", num_bits=4, group_size=16), fmt="nvfp4-pack-quantized"
            ),
            "4-bit float weights",
        ),
        (_config(_weights("block", block_structure=[128, 128])), "weight strategy 'block'"),
        (_config(_weights("group", group_size=128)), "weight strategy 'group'"),
        (_config(_weights(symmetric=False)), r"asymmetric weights \(zero points\)"),
        (_config(fmt="pack-quantized"), "format 'pack-quantized'"),
        (_config(fmt="dense"), "format 'dense'"),
        (_config(weights={}, input_activations=DYNAMIC), r"no weight quantization"),
        (
            _config(sparsity_config={"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}),
            r"sparse weights \(sparsity_config\)",
        ),
        (_config(kv_cache_scheme=STATIC), r"a quantized KV cache \(kv_cache_scheme\)"),
        (_config(output_activations=STATIC), "'group_0': quantized output activations"),
    ],
    ids=[
        "int8",
        "int4-packed",
        "nvfp4",
        "fp8-block",
        "fp8-group",
        "asymmetric",
        "packed-format",
        "dense-format",
        "activations-only",
        "sparse",
        "kv-cache",
        "output-activations",
    ],
)
def test_other_compressed_tensors_schemes_are_refused_naming_why(
    tiny_model_dir, tmp_path, config, refusal
):
    model_dir = tiny_model_dir("llama")
    out = tmp_path / "ct"
    copy_config(model_dir, out, config)
    shutil.copy(model_dir / "model.safetensors", out)
    with pytest.raises(ModelLoadError, match=rf"compressed-tensors checkpoint with .*{refusal}"):
        LLM(str(out), backend="template")


def test_a_dense_sparsity_config_is_no_sparsity_and_activations_read_in_words(tmp_path):
    """Older llm-compressor releases write ``sparsity_config: {"format": "dense", ...}`` beside
    FP8 weights: the weights are stored as they are, so the checkpoint loads."""
    dense = {"format": "dense", "global_sparsity": 0.0, "sparsity_structure": "unstructured"}
    no_strategy = {**DYNAMIC, "strategy": None}
    scheme = compressed_fp8_scheme(
        _config(sparsity_config=dense, input_activations=no_strategy), tmp_path
    )
    assert (scheme.targets, scheme.ignore) == (("Linear",), ("lm_head",))
    assert scheme.activations == "8-bit float, dynamic"
    assert compressed_fp8_scheme(_config(input_activations=STATIC), tmp_path).activations == (
        "8-bit float, static, per tensor"
    )
