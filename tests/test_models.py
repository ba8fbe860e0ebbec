"""Our Llama-family models against HF transformers (the loader's error paths: test_model_loading).

Every forward runs through the reference paged-attention ops over a cache whose block tables
are shuffled (non-contiguous), so slot mapping and block-table handling are exercised too.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from platform_core.attention.metadata import AttentionMetadata
from platform_core.errors import BackendError
from platform_core.layers.ops import LayerOps
from platform_core.models.loader import dtype_from_config
from tests.conftest import TINY_MODELS, load_on_cpu

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
    model = load_on_cpu(tiny_model_dir(name), reference_attention_ops)
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
    model = load_on_cpu(tiny_model_dir(name), reference_attention_ops)
    tokens = _prompt(30, model.vocab_size, seed=2)
    expected = _hf_logits(hf_reference_model(name), tokens)
    runner = PagedRunner(model, reference_attention_ops, seed=3)
    _close(runner.step({"s": tokens[:11]})["s"], expected[:11])
    _close(runner.step({"s": tokens[11:20]})["s"], expected[11:20])
    for pos in range(20, 30):
        _close(runner.step({"s": [tokens[pos]]})["s"][0], expected[pos])


@pytest.mark.parametrize("name", ARCHS)
def test_batched_sequences_equal_each_alone(name, tiny_model_dir, reference_attention_ops):
    model = load_on_cpu(tiny_model_dir(name), reference_attention_ops)
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
    model = load_on_cpu(tiny_model_dir("qwen3"), reference_attention_ops)
    assert (model.num_layers, model.num_heads, model.num_kv_heads) == (2, 4, 2)
    assert (model.head_size, model.vocab_size, model.max_position) == (32, 256, 1024)
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.weight.shape == ((4 + 2 + 2) * 32, 64)
    assert model.model.layers[0].mlp.gate_up_proj.weight.shape == (2 * 128, 64)
    assert attn.attn.scale == pytest.approx(32**-0.5)


def test_tied_embeddings_share_the_embedding(tiny_model_dir, reference_attention_ops):
    model_dir = tiny_model_dir("llama_tied")
    assert "lm_head.weight" not in load_file(model_dir / "model.safetensors")
    model = load_on_cpu(model_dir, reference_attention_ops)
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    _close(model.compute_logits(hidden), hidden @ model.model.embed_tokens.weight.T)


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
    patched = load_on_cpu(model_dir, reference_attention_ops, op_overrides=overrides)
    plain = load_on_cpu(model_dir, reference_attention_ops)
    tokens = _prompt(9, 256, seed=9)
    ours = PagedRunner(patched, reference_attention_ops).step({"a": tokens})["a"]
    layers = patched.num_layers
    # per layer: 2 residual norms + q_norm + k_norm; plus the final norm
    assert counts == {"rms_norm": 4 * layers + 1, "rotary": layers, "silu_and_mul": layers}
    _close(ours, PagedRunner(plain, reference_attention_ops).step({"a": tokens})["a"], atol=0)


def test_a_misspelt_op_override_is_an_error_naming_it(tiny_model_dir, reference_attention_ops):
    with pytest.raises(BackendError, match=r"'rmsnorm' \(did you mean 'rms_norm'\?\)"):
        load_on_cpu(tiny_model_dir("llama"), reference_attention_ops, op_overrides={"rmsnorm": abs})


def test_bfloat16_model_runs_close_to_float32(tiny_model_dir, reference_attention_ops):
    model_dir = tiny_model_dir("llama")
    low = load_on_cpu(model_dir, reference_attention_ops, dtype=torch.bfloat16)
    assert {p.dtype for p in low.parameters()} == {torch.bfloat16}
    assert low.model.rotary_emb.cos_sin_cache.dtype == torch.bfloat16
    tokens = _prompt(20, 256, seed=10)
    runner = PagedRunner(low, reference_attention_ops)
    runner.kv_caches = [c.bfloat16() for c in runner.kv_caches]
    logits = runner.step({"a": tokens})["a"]
    assert logits.dtype == torch.bfloat16  # the model's dtype: the sampler widens what it needs
    full = PagedRunner(load_on_cpu(model_dir, reference_attention_ops), reference_attention_ops)
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
