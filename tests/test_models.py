"""Our Llama-family models against HF transformers, and the loader's error paths.

Every forward runs through the reference paged-attention ops over a cache whose block tables
are shuffled (non-contiguous), so slot mapping and block-table handling are exercised too.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from platform_core.attention.metadata import AttentionMetadata
from platform_core.errors import BackendError, ModelLoadError
from platform_core.layers.ops import LayerOps
from platform_core.layers.rotary import RopeScaling
from platform_core.models.decoder_spec import DecoderSpec
from platform_core.models.loader import dtype_from_config, load_model
from platform_core.models.registry import get_model_class, supported_architectures
from tests.conftest import TINY_MODELS

BLOCK_SIZE = 4
NUM_BLOCKS = 64
CPU = torch.device("cpu")


class PagedRunner:
    """Feeds token chunks of several sequences through a model over a shuffled paged cache."""

    def __init__(self, model: Any, ops: Any, seed: int = 0) -> None:
        self.model = model
        shape = ops.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, model.num_kv_heads, model.head_size)
        self.kv_caches = [torch.zeros(shape) for _ in range(model.num_layers)]
        gen = torch.Generator().manual_seed(seed)
        self.free_blocks = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
        self.tables: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}

    def step(self, chunks: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Run one flattened forward; returns each sequence's logits for its new tokens."""
        ids, positions, slots, starts, seq_lens = [], [], [], [0], []
        for seq, tokens in chunks.items():
            start = self.lengths.get(seq, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(seq, [])
            while len(table) * BLOCK_SIZE < end:
                table.append(self.free_blocks.pop())
            ids += tokens
            positions += range(start, end)
            slots += [_slot(table, p) for p in range(start, end)]
            starts.append(starts[-1] + len(tokens))
            seq_lens.append(end)
            self.lengths[seq] = end
        width = max(len(self.tables[s]) for s in chunks)
        tables = [self.tables[s] + [0] * (width - len(self.tables[s])) for s in chunks]
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(len(t) for t in chunks.values()),
            max_seq_len=max(seq_lens),
            block_size=BLOCK_SIZE,
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
        )
        with torch.inference_mode():
            hidden = self.model(
                torch.tensor(ids), torch.tensor(positions), self.kv_caches, metadata
            )
            logits = self.model.compute_logits(hidden)
        return {seq: logits[starts[i] : starts[i + 1]] for i, seq in enumerate(chunks)}


def _slot(table: list[int], position: int) -> int:
    return table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE


def _load(model_dir: Path, ops: Any, dtype: torch.dtype = torch.float32, **kwargs: Any) -> Any:
    return load_model(model_dir, AutoConfig.from_pretrained(model_dir), dtype, CPU, ops, **kwargs)


def _prompt(length: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=gen).tolist()


def _hf_logits(hf_model: Any, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def _close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-4) -> None:
    torch.testing.assert_close(actual, expected, atol=atol, rtol=1e-4)


ARCHS = list(TINY_MODELS)


@pytest.mark.parametrize("name", ARCHS)
def test_full_prefill_matches_hf(name, tiny_model_dir, hf_reference_model, reference_attention_ops):
    model = _load(tiny_model_dir(name), reference_attention_ops)
    tokens = _prompt(70, model.vocab_size, seed=1)
    runner = PagedRunner(model, reference_attention_ops)
    ours = runner.step({"a": tokens})["a"]
    table = runner.tables["a"]
    assert table != list(range(table[0], table[0] + len(table)))  # really non-contiguous
    _close(ours, _hf_logits(hf_reference_model(name), tokens))


@pytest.mark.parametrize("name", ARCHS)
def test_chunked_prefill_then_decode_matches_hf(
    name, tiny_model_dir, hf_reference_model, reference_attention_ops
):
    model = _load(tiny_model_dir(name), reference_attention_ops)
    tokens = _prompt(30, model.vocab_size, seed=2)
    expected = _hf_logits(hf_reference_model(name), tokens)
    runner = PagedRunner(model, reference_attention_ops, seed=3)
    _close(runner.step({"s": tokens[:11]})["s"], expected[:11])
    _close(runner.step({"s": tokens[11:20]})["s"], expected[11:20])
    for pos in range(20, 30):
        _close(runner.step({"s": [tokens[pos]]})["s"][0], expected[pos])


@pytest.mark.parametrize("name", ARCHS)
def test_batched_sequences_equal_each_alone(name, tiny_model_dir, reference_attention_ops):
    model = _load(tiny_model_dir(name), reference_attention_ops)
    a, b = _prompt(13, model.vocab_size, seed=4), _prompt(26, model.vocab_size, seed=5)
    batched = PagedRunner(model, reference_attention_ops, seed=6)
    alone_a = PagedRunner(model, reference_attention_ops, seed=7)
    alone_b = PagedRunner(model, reference_attention_ops, seed=8)
    # step 1: two prefills; step 2: a decode of `a` mixed with a prefill chunk of `b`
    steps = [({"a": a[:12], "b": b[:21]}), ({"a": a[12:], "b": b[21:]})]
    for chunks in steps:
        together = batched.step(chunks)
        _close(together["a"], alone_a.step({"a": chunks["a"]})["a"], atol=1e-5)
        _close(together["b"], alone_b.step({"b": chunks["b"]})["b"], atol=1e-5)


def test_model_shape_attributes_and_fused_projections(tiny_model_dir, reference_attention_ops):
    model = _load(tiny_model_dir("qwen3"), reference_attention_ops)
    assert (model.num_layers, model.num_heads, model.num_kv_heads) == (2, 4, 2)
    assert (model.head_size, model.vocab_size, model.max_position) == (32, 256, 1024)
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.weight.shape == ((4 + 2 + 2) * 32, 64)
    assert model.model.layers[0].mlp.gate_up_proj.weight.shape == (2 * 128, 64)
    assert attn.attn.scale == pytest.approx(32**-0.5)


def test_tied_embeddings_share_the_embedding(tiny_model_dir, reference_attention_ops):
    model_dir = tiny_model_dir("llama_tied")
    assert "lm_head.weight" not in load_file(model_dir / "model.safetensors")
    model = _load(model_dir, reference_attention_ops)
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    _close(model.compute_logits(hidden), hidden @ model.model.embed_tokens.weight.T)


def test_tied_checkpoint_with_redundant_lm_head_loads(
    tiny_model_dir, reference_attention_ops, tmp_path
):
    source = tiny_model_dir("llama_tied")
    tensors = load_file(source / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    model_dir = _copy_with_tensors(source, tmp_path, tensors)
    model = _load(model_dir, reference_attention_ops)
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
        _load(_copy_with_tensors(source, tmp_path, tensors), reference_attention_ops)


def test_unexpected_weight_is_named(tiny_model_dir, reference_attention_ops, tmp_path):
    source = tiny_model_dir("llama")
    tensors = load_file(source / "model.safetensors")
    tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4)
    with pytest.raises(ModelLoadError, match=r"unexpected weight.*extra_proj"):
        _load(_copy_with_tensors(source, tmp_path, tensors), reference_attention_ops)


def test_wrong_shape_is_named(tiny_model_dir, reference_attention_ops, tmp_path):
    source = tiny_model_dir("qwen2")
    tensors = load_file(source / "model.safetensors")
    tensors["model.layers.2.self_attn.v_proj.bias"] = torch.zeros(7)
    with pytest.raises(ModelLoadError, match=r"v_proj\.bias.*\(7,\), expected \(32,\)"):
        _load(_copy_with_tensors(source, tmp_path, tensors), reference_attention_ops)


def test_sharded_checkpoint_loads_like_single_file(
    tiny_model_dir, hf_reference_model, reference_attention_ops, tmp_path
):
    hf_reference_model("qwen2").save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    sharded = _load(tmp_path, reference_attention_ops).state_dict()
    single = _load(tiny_model_dir("qwen2"), reference_attention_ops).state_dict()
    assert sharded.keys() == single.keys()
    for key, value in single.items():
        assert torch.equal(sharded[key], value), key


def test_pickle_only_checkpoint_is_refused(tiny_model_dir, reference_attention_ops, tmp_path):
    shutil.copy(tiny_model_dir("llama") / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors.*pytorch_model\.bin"):
        _load(tmp_path, reference_attention_ops)


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


def _counting(counts: dict[str, int], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any) -> Any:
        counts[name] += 1
        return fn(*args)

    return wrapper


def test_op_overrides_replace_the_defaults(tiny_model_dir, reference_attention_ops):
    defaults = LayerOps()
    counts = dict.fromkeys(("rms_norm", "rotary", "silu_and_mul"), 0)
    overrides = {n: _counting(counts, n, getattr(defaults, n)) for n in counts}
    model_dir = tiny_model_dir("qwen3")
    patched = _load(model_dir, reference_attention_ops, op_overrides=overrides)
    plain = _load(model_dir, reference_attention_ops)
    tokens = _prompt(9, 256, seed=9)
    ours = PagedRunner(patched, reference_attention_ops).step({"a": tokens})["a"]
    layers = patched.num_layers
    # per layer: 2 residual norms + q_norm + k_norm; plus the final norm
    assert counts == {"rms_norm": 4 * layers + 1, "rotary": layers, "silu_and_mul": layers}
    _close(ours, PagedRunner(plain, reference_attention_ops).step({"a": tokens})["a"], atol=0)


def test_a_misspelt_op_override_is_an_error_naming_it(tiny_model_dir, reference_attention_ops):
    with pytest.raises(BackendError, match=r"'rmsnorm' \(did you mean 'rms_norm'\?\)"):
        _load(tiny_model_dir("llama"), reference_attention_ops, op_overrides={"rmsnorm": abs})


def test_bfloat16_model_runs_close_to_float32(tiny_model_dir, reference_attention_ops):
    model_dir = tiny_model_dir("llama")
    low = _load(model_dir, reference_attention_ops, dtype=torch.bfloat16)
    assert {p.dtype for p in low.parameters()} == {torch.bfloat16}
    assert low.model.rotary_emb.cos_sin_cache.dtype == torch.bfloat16
    tokens = _prompt(20, 256, seed=10)
    runner = PagedRunner(low, reference_attention_ops)
    runner.kv_caches = [c.bfloat16() for c in runner.kv_caches]
    logits = runner.step({"a": tokens})["a"]
    assert logits.dtype == torch.bfloat16  # the model's dtype: the sampler widens what it needs
    full = PagedRunner(_load(model_dir, reference_attention_ops), reference_attention_ops)
    reference = full.step({"a": tokens})["a"]
    assert reference.dtype == torch.float32
    assert (logits.float() - reference).abs().max() < 0.05 * reference.abs().max()


@pytest.mark.parametrize(
    ("declared", "requested", "expected"),
    [
        ("bfloat16", "auto", torch.bfloat16),
        (torch.float16, "auto", torch.float16),
        ("float32", "auto", torch.float32),
        (None, "auto", torch.float32),
        ("int8", "auto", torch.float32),
        ("bfloat16", "float32", torch.float32),
        ("float32", "bfloat16", torch.bfloat16),
    ],
)
def test_dtype_from_config(declared, requested, expected):
    assert dtype_from_config(SimpleNamespace(dtype=declared), requested) == expected


def test_dtype_from_config_reads_legacy_torch_dtype():
    assert dtype_from_config(SimpleNamespace(torch_dtype="bfloat16"), "auto") == torch.bfloat16
