"""Loading checkpoints: tied and sharded files, and errors that name the weight, the architecture
or the config field at fault."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from platform_core.errors import ModelLoadError
from platform_core.layers.rotary import RopeScaling
from platform_core.models.decoder_spec import DecoderSpec
from platform_core.models.loader import load_model
from platform_core.models.registry import get_model_class, supported_architectures
from tests.conftest import load_on_cpu

CPU = torch.device("cpu")


def test_tied_checkpoint_with_redundant_lm_head_loads(
    tiny_model_dir, reference_attention_ops, tmp_path
):
    source = tiny_model_dir("llama_tied")
    tensors = load_file(source / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    model_dir = _copy_with_tensors(source, tmp_path, tensors)
    model = load_on_cpu(model_dir, reference_attention_ops)
    assert model.lm_head is None


def _copy_with_tensors(source: Path, dest: Path, tensors: dict[str, torch.Tensor]) -> Path:
    shutil.copy(source / "config.json", dest / "config.json")
    save_file(tensors, dest / "model.safetensors")
    return dest


@pytest.mark.parametrize(
    "removed",
    [
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ],
)
def test_missing_weight_is_named(removed, tiny_model_dir, reference_attention_ops, tmp_path):
    source = tiny_model_dir("llama")
    tensors = load_file(source / "model.safetensors")
    del tensors[removed]
    with pytest.raises(ModelLoadError, match=rf"missing weight.*{re.escape(removed)}"):
        load_on_cpu(_copy_with_tensors(source, tmp_path, tensors), reference_attention_ops)


def test_unexpected_weight_is_named(tiny_model_dir, reference_attention_ops, tmp_path):
    source = tiny_model_dir("llama")
    tensors = load_file(source / "model.safetensors")
    tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4)
    with pytest.raises(ModelLoadError, match=r"unexpected weight.*extra_proj"):
        load_on_cpu(_copy_with_tensors(source, tmp_path, tensors), reference_attention_ops)


def test_wrong_shape_is_named(tiny_model_dir, reference_attention_ops, tmp_path):
    source = tiny_model_dir("qwen2")
    tensors = load_file(source / "model.safetensors")
    tensors["model.layers.2.self_attn.v_proj.bias"] = torch.zeros(7)
    with pytest.raises(ModelLoadError, match=r"v_proj\.bias.*\(7,\), expected \(32,\)"):
        load_on_cpu(_copy_with_tensors(source, tmp_path, tensors), reference_attention_ops)


def test_sharded_checkpoint_loads_like_single_file(
    tiny_model_dir, hf_reference_model, reference_attention_ops, tmp_path
):
    hf_reference_model("qwen2").save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    sharded = load_on_cpu(tmp_path, reference_attention_ops).state_dict()
    single = load_on_cpu(tiny_model_dir("qwen2"), reference_attention_ops).state_dict()
    assert sharded.keys() == single.keys()
    for key, value in single.items():
        assert torch.equal(sharded[key], value), key


def test_pickle_only_checkpoint_is_refused(tiny_model_dir, reference_attention_ops, tmp_path):
    shutil.copy(tiny_model_dir("llama") / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors.*pytorch_model\.bin"):
        load_on_cpu(tmp_path, reference_attention_ops)


def test_registry_maps_each_architecture():
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert get_model_class(SimpleNamespace(architectures=[arch])).__name__ == arch
    with pytest.raises(ModelLoadError) as info:
        get_model_class(SimpleNamespace(architectures=["GPT2LMHeadModel"]))
    assert "GPT2LMHeadModel" in str(info.value)
    assert all(arch in str(info.value) for arch in supported_architectures())


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic"])
def test_unsupported_rope_type_is_named(rope_type, tiny_model_dir, reference_attention_ops):
    model_dir = tiny_model_dir("llama")
    config = AutoConfig.from_pretrained(model_dir)
    config.rope_parameters = {"rope_type": rope_type, "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ModelLoadError, match=rope_type):
        load_model(model_dir, config, torch.float32, CPU, reference_attention_ops)


def test_sliding_window_is_rejected_unless_it_spans_the_context(
    tiny_model_dir, reference_attention_ops
):
    model_dir = tiny_model_dir("mistral")
    config = AutoConfig.from_pretrained(model_dir)
    config.sliding_window = 16
    with pytest.raises(ModelLoadError, match="sliding_window=16"):
        load_model(model_dir, config, torch.float32, CPU, reference_attention_ops)
    config.sliding_window = config.max_position_embeddings
    load_model(model_dir, config, torch.float32, CPU, reference_attention_ops)


def test_transformers_4_rope_fields_read_like_transformers_5(tiny_model_dir):
    modern = AutoConfig.from_pretrained(tiny_model_dir("llama3_rope"))
    legacy_fields = {k: v for k, v in modern.to_dict().items() if k != "rope_parameters"}
    scaling = {k: v for k, v in modern.rope_parameters.items() if k != "rope_theta"}
    legacy = SimpleNamespace(
        **legacy_fields,
        rope_theta=500000.0,
        rope_scaling={**scaling, "type": scaling.pop("rope_type")},
    )
    expected = RopeScaling(500000.0, "llama3", 8.0, 1.0, 4.0, 64)
    assert DecoderSpec.from_hf(legacy).rope == expected
    assert DecoderSpec.from_hf(modern).rope == expected
