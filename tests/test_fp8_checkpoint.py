"""Checkpoints stored in FP8 (issue #25): float8 e4m3 weights with a per-tensor or per-row
``weight_scale`` (``quant_method: fp8``) kept as stored bit for bit, dequantized where the
backend has no FP8 kernel, sharded under tensor parallelism, and the ones we cannot load
refused, naming why."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from quantized_models import (
    LINEARS_PER_MODEL,
    assert_same,
    copy_config,
    generate,
    write_fp8_checkpoint,
)
from safetensors.torch import load_file, save_file

from platform_core import LLM
from platform_core.errors import ModelLoadError
from platform_core.quantization.formats import fp8_rows

FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "static"}


def _write_fp8_checkpoint(model_dir: Path, out: Path, config: dict = FP8_CONFIG) -> Path:
    """``model_dir`` stored in FP8 the Hugging Face way: each linear's weight as float8 e4m3
    with a float32 ``weight_scale``, one per output row, but one for the whole tensor in the
    ``q_proj`` and ``down_proj`` weights; a static ``input_scale`` beside each."""
    per_tensor = ("q_proj.weight", "down_proj.weight")
    return write_fp8_checkpoint(model_dir, out, config, lambda name: name.endswith(per_tensor))


def _dequantized_copy(fp8_dir: Path, out: Path) -> Path:
    """The FP8 checkpoint ``fp8_dir`` as float32 weights (``weight * weight_scale``)."""
    copy_config(fp8_dir, out)
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(fp8_dir / "model.safetensors")
    dense = {
        name: value.float() * tensors.get(f"{name}_scale", torch.tensor(1.0))
        for name, value in tensors.items()
        if not name.endswith("_scale")
    }
    save_file(dense, out / "model.safetensors", {"format": "pt"})
    return out


@pytest.fixture(scope="module")
def fp8_checkpoint(tiny_model_dir, tmp_path_factory) -> tuple[Path, Path]:
    """An FP8 checkpoint of the tiny model, and the same weights dequantized."""
    root = tmp_path_factory.mktemp("fp8-checkpoint")
    stored = _write_fp8_checkpoint(tiny_model_dir("llama"), root / "fp8")
    return stored, _dequantized_copy(stored, root / "dense")


def test_an_fp8_checkpoint_is_kept_as_stored_and_gives_its_dequantized_tokens(fp8_checkpoint):
    stored, dense_dir = fp8_checkpoint
    common = {"backend": "template", "dtype": "float32"}
    quantized, runner = generate(stored, quantization="fp8", **common)
    assert runner.quantization == f"quantized FP8_E4M3 x {LINEARS_PER_MODEL}"
    tensors = load_file(stored / "model.safetensors")
    layers = dict(runner.model.named_modules())
    for part in ("mlp.down_proj", "self_attn.o_proj"):  # per tensor, per row
        name = f"model.layers.1.{part}.weight"
        want = fp8_rows(tensors[name], tensors[f"{name}_scale"])
        assert torch.equal(layers[f"model.layers.1.{part}"].weight, want), name
    assert_same(quantized, generate(dense_dir, **common)[0])


@pytest.mark.parametrize("backend", ["template", "cpu"])
def test_an_fp8_checkpoint_runs_dequantized_where_the_backend_has_no_kernel(
    fp8_checkpoint, caplog, backend
):
    """Dequantized once at load: the reference op would dequantize on every step."""
    stored, dense_dir = fp8_checkpoint
    with caplog.at_level(logging.INFO, logger="platform_core.engine"):
        outputs, runner = generate(stored, backend=backend)
    assert runner.quantization is None
    # no op at all, or (the CPU backend's) one without an FP8 kernel
    assert re.search(rf"backend {backend}('s quantized_linear)? has no \w* ?kernel", caplog.text)
    assert "quantization='fp8' to keep them" in caplog.text
    assert_same(outputs, generate(dense_dir, backend=backend)[0], atol=1e-3)


def test_an_fp8_checkpoint_under_tensor_parallelism_gives_one_rank_tokens(fp8_checkpoint):
    stored, _ = fp8_checkpoint
    common = {"backend": "template", "dtype": "float32", "quantization": "fp8"}
    one, _ = generate(stored, **common)
    two, runner = generate(stored, tensor_parallel_size=2, **common)
    assert runner.quantization == f"quantized FP8_E4M3 x {LINEARS_PER_MODEL}"
    assert_same(two, one)


def test_fp8_checkpoints_we_cannot_load_are_refused_naming_why(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("llama")
    blockwise = {**FP8_CONFIG, "weight_block_size": [128, 128]}
    stored = _write_fp8_checkpoint(model_dir, tmp_path / "blockwise", blockwise)
    with pytest.raises(ModelLoadError, match=r"block-wise scales \(weight_block_size \[128, 128\]"):
        LLM(str(stored), backend="template", quantization="fp8")
    stored = _write_fp8_checkpoint(model_dir, tmp_path / "unscaled")
    tensors = load_file(stored / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight_scale"]
    save_file(tensors, stored / "model.safetensors", {"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"up_proj.weight' is stored as float8 but .* no"):
        LLM(str(stored), backend="template", quantization="fp8")
    # scales that fit neither the tensor nor its rows (one per two rows)
    name = "model.layers.0.mlp.up_proj.weight_scale"
    tensors[name] = torch.ones(tensors["model.layers.0.mlp.up_proj.weight"].shape[0] // 2, 1)
    save_file(tensors, stored / "model.safetensors", {"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"up_proj.weight_scale has shape \(\d+, 1\)"):
        LLM(str(stored), backend="template", quantization="fp8")
