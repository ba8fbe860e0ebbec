"""GGUF weights kept quantized (issue #25): the block formats against the gguf package, the
materialized blocks against the dequantized weights, which linears keep their blocks (and the
log of those that do not), the choice of ``quantization``, and whole models computed on blocks
through the reference op giving the dequantized model's tokens, with tensor parallelism too."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from gguf_utils import random_blocks, write_tiny_gguf
from quantized_models import PARAMS, PROMPTS, assert_same, generate
from safetensors.torch import load_file

from platform_core import LLM, SamplingParams
from platform_core.distributed.parallel_state import TPGroup
from platform_core.errors import ConfigError, ModelLoadError
from platform_core.layers.linear import RowParallelLinear
from platform_core.models.gguf_loader import CACHE_ENV, materialize_gguf
from platform_core.models.quantized_checkpoint import QUANTIZED_FILE, quantized_formats
from platform_core.quantization.formats import (
    Q4_1,
    Q8_0,
    QUANT_FORMATS,
    dequantize,
    quantize,
    quantized_linear,
)

GGML = gguf.GGMLQuantizationType


@pytest.mark.parametrize("name", sorted(QUANT_FORMATS))
def test_each_format_dequantizes_as_the_gguf_package_does(name):
    rng = np.random.default_rng(7)
    blocks = random_blocks(5, 512, GGML[name], rng)
    expected = gguf.quants.dequantize(blocks, GGML[name])
    ours = dequantize(torch.from_numpy(blocks), QUANT_FORMATS[name]).numpy()
    assert ours.shape == expected.shape == (5, 512)
    np.testing.assert_array_equal(ours, expected)


def test_every_float16_scale_decodes_exactly():
    """All 65,536 bit patterns of a Q8_0 scale (subnormals, infinities, NaNs), times q = 1."""
    patterns = np.arange(1 << 16, dtype=np.uint16)
    blocks = np.zeros((1 << 16, 34), dtype=np.uint8)
    blocks[:, :2] = patterns.view(np.uint8).reshape(-1, 2)
    blocks[:, 2] = 1
    ours = dequantize(torch.from_numpy(blocks), QUANT_FORMATS["Q8_0"])[:, 0].numpy()
    np.testing.assert_array_equal(ours, patterns.view(np.float16).astype(np.float32))


def test_the_reference_op_keeps_the_input_dtype_and_adds_the_bias():
    rng = np.random.default_rng(1)
    qweight = torch.from_numpy(random_blocks(6, 64, GGML.Q4_1, rng))
    x, bias = torch.randn(3, 64), torch.randn(6)
    expected = x @ dequantize(qweight, Q4_1).T + bias
    torch.testing.assert_close(quantized_linear(x, qweight, Q4_1, bias), expected)
    assert quantized_linear(x.bfloat16(), qweight, Q4_1, None).dtype == torch.bfloat16


def test_bad_blocks_are_refused():
    with pytest.raises(ValueError, match="not whole Q4_1 blocks"):
        dequantize(torch.zeros(2, 30, dtype=torch.uint8), Q4_1)
    with pytest.raises(ValueError, match="uint8"):
        dequantize(torch.zeros(2, 40), Q4_1)
    with pytest.raises(ValueError, match="multiple"):
        Q4_1.row_bytes(48)


def test_a_column_shard_must_be_whole_blocks():
    tp = TPGroup(rank=1, size=2, communicator=SimpleNamespace(rank=1, world_size=2))
    linear = RowParallelLinear(96, 8, False, torch.float32, tp)  # columns 48:96
    with pytest.raises(ValueError, match="48:96 of 96 are not whole Q4_1 blocks of 32"):
        linear.keep_quantized(Q4_1)
    aligned = RowParallelLinear(128, 8, False, torch.float32, tp)
    aligned.keep_quantized(Q4_1)
    assert aligned.weight.shape == (8, 2 * 20) and aligned.weight.dtype == torch.uint8
    (placement,) = aligned.placements("weight")
    assert (placement.source.start, placement.source.full) == (40, 80)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path


def _materialize(path, **kwargs):
    return materialize_gguf(write_tiny_gguf(path, **kwargs))


def test_materialized_blocks_are_the_dequantized_weights_as_stored(cache):
    model_dir = _materialize(cache / "mixed.gguf")
    formats = quantized_formats(model_dir)
    dense = load_file(model_dir / "model.safetensors")
    blocks = load_file(model_dir / QUANTIZED_FILE)
    assert set(formats) == set(blocks) and set(formats.values()) == {"Q8_0", "Q4_1"}
    assert not any(name.startswith("model.layers.1.") for name in formats)  # F16 there
    # Rope rows undone on the blocks as on the values: q_proj/k_proj included.
    assert "model.layers.0.self_attn.q_proj.weight" in formats
    for name, fmt in formats.items():
        torch.testing.assert_close(dequantize(blocks[name], QUANT_FORMATS[fmt]), dense[name])


def _summary(qtype: str) -> str:
    """The start-up summary of a tiny GGUF with every linear in ``qtype``: 4 linears per layer,
    2 layers, and the tied embedding in Q8_0."""
    return "quantized Q8_0 x 9" if qtype == "Q8_0" else f"quantized {qtype} x 8, Q8_0 x 1"


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_a_model_on_blocks_through_the_reference_op_gives_the_dequantized_tokens(cache, qtype):
    model_dir = _materialize(cache / f"{qtype}.gguf", qtype=GGML[qtype], ffn=128)
    common = {"backend": "template", "dtype": "float32"}
    quantized, runner = generate(model_dir, quantization="gguf", **common)
    assert runner.quantization == _summary(qtype)
    dense, dense_runner = generate(model_dir, quantization="none", **common)
    assert dense_runner.quantization is None
    assert runner.weights_bytes < dense_runner.weights_bytes
    assert runner.parameter_count == dense_runner.parameter_count
    assert_same(quantized, dense)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_k_quants_load_and_match_the_dequantized_model(cache, qtype):
    model_dir = _materialize(cache / f"{qtype}.gguf", qtype=GGML[qtype], hidden=256, ffn=512)
    common = {"backend": "template", "dtype": "float32"}
    quantized, runner = generate(model_dir, quantization="gguf", **common)
    assert runner.quantization == _summary(qtype)
    assert_same(quantized, generate(model_dir, quantization="none", **common)[0])


def test_fused_parts_in_different_formats_run_dequantized_and_say_so(cache, caplog):
    model_dir = _materialize(cache / "mixed.gguf", types={"blk.0.attn_v.weight": GGML.Q8_0})
    with caplog.at_level(logging.INFO, logger="platform_core.models"):
        _, runner = generate(model_dir, backend="template", dtype="float32", quantization="gguf")
    # layer 0: q and k are Q4_1, v Q8_0; o_proj Q8_0, gate/up and down Q4_1; layer 1 is F16;
    # the tied embedding Q4_1
    assert runner.quantization == "quantized Q4_1 x 3, Q8_0 x 1"
    log = caplog.text
    for part in ("q_proj", "k_proj", "v_proj"):
        assert f"model.layers.0.self_attn.{part}.weight" in log
    assert "different formats" in log and "embed_tokens" not in log


def test_quantization_is_chosen_from_the_checkpoint_the_dtype_and_the_backend(
    cache, tiny_model_dir, caplog
):
    model_dir = _materialize(cache / "q.gguf", qtype=GGML.Q8_0)
    with caplog.at_level(logging.INFO, logger="platform_core.engine"):
        # the template backend has no quantized_linear of its own: auto dequantizes once
        assert generate(model_dir, backend="template")[1].quantization is None
    assert "backend template has no quantized_linear kernel of its own" in caplog.text
    assert generate(model_dir, backend="template", quantization="gguf")[1].quantization
    with pytest.raises(ConfigError, match="keeps no quantized tensors"):
        LLM(str(tiny_model_dir("llama")), quantization="gguf")
    with pytest.raises(ConfigError, match="quantization='int3' is not supported"):
        LLM(str(model_dir), quantization="int3")


def test_a_linear_in_a_format_we_cannot_compute_on_is_refused_naming_it(cache):
    model_dir = _materialize(cache / "q5.gguf", qtype=GGML.Q5_0)
    with pytest.raises(ModelLoadError, match=r"GGUF type Q5_0.*quantization='none'"):
        LLM(str(model_dir), backend="template", quantization="gguf")
    dense, runner = generate(model_dir, backend="template", quantization="none")
    assert runner.quantization is None and len(dense[0].token_ids) == PARAMS.max_tokens


def test_tensor_parallel_ranks_hold_their_blocks_and_give_one_rank_tokens(cache):
    """Row shards, whole-block column shards and vocabulary shards of an untied output head."""
    model_dir = _materialize(cache / "tp.gguf", qtype=GGML.Q4_1, ffn=128, tied=False)
    common = {"backend": "template", "dtype": "float32", "quantization": "gguf"}
    one, _ = generate(model_dir, **common)
    two, runner = generate(model_dir, tensor_parallel_size=2, **common)
    assert runner.quantization == "quantized Q4_1 x 9, Q8_0 x 1"  # the head is Q4_1 too
    assert_same(two, one)
    assert_same(one, generate(model_dir, backend="template", dtype="float32")[0])


@pytest.mark.parametrize("fmt", [Q8_0, Q4_1], ids=lambda f: f.name)
def test_quantizing_rounds_to_the_nearest_step_like_the_gguf_package(fmt):
    weights = torch.randn(16, 256) * torch.linspace(0.01, 3, 256)  # scales differ per block
    blocks = quantize(weights, fmt)
    restored = dequantize(blocks, fmt)
    groups = weights.unflatten(1, (-1, 32))
    levels = 254 if fmt is Q8_0 else 15
    span = groups.amax(-1) - groups.amin(-1) if fmt is Q4_1 else 2 * groups.abs().amax(-1)
    step = (span / levels).repeat_interleave(32, dim=1)
    assert ((restored - weights).abs() <= 0.5 * step * 1.01 + 1e-6).all()  # float16 scales
    theirs = torch.from_numpy(gguf.quants.quantize(weights.numpy(), GGML[fmt.name]))
    assert ((restored - dequantize(theirs, fmt)).abs() <= step * 1.01).all()
    assert (blocks == theirs).float().mean() > 0.95


@pytest.mark.parametrize(
    ("mode", "summary", "logprob_atol"),
    [("int8", "quantized Q8_0 x 10", 0.05), ("int4", "quantized Q4_1 x 8, Q8_0 x 2", 0.3)],
)
def test_a_16_bit_checkpoint_quantized_at_load_time(tiny_model_dir, mode, summary, logprob_atol):
    """Linears in Q8_0 / Q4_1, embedding and untied head in Q8_0; the first token of each
    prompt (same context on both sides) is one the float model rates near its own best."""
    model_dir = tiny_model_dir("llama")
    first = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    prompts = [{"prompt_token_ids": p} for p in [*PROMPTS, [7, 8], [200] * 9]]

    def run(**kwargs):
        with LLM(str(model_dir), backend="template", dtype="float32", **kwargs) as llm:
            outputs = llm.generate(prompts, first, use_tqdm=False)
            return [o.outputs[0] for o in outputs], llm.engine.runner

    quantized, runner = run(quantization=mode)
    assert runner.quantization == summary
    dense, dense_runner = run()
    assert runner.weights_bytes < dense_runner.weights_bytes / 2.5
    for ours, theirs in zip(quantized, dense, strict=True):
        token = ours.token_ids[0]
        rated = theirs.logprobs[0]
        assert token in rated, (token, rated)
        assert abs(rated[token].logprob - ours.logprobs[0][token].logprob) < logprob_atol


def test_load_time_quantization_under_tensor_parallelism_quantizes_each_ranks_part(
    tiny_model_dir,
):
    """Column shards are quantized from their own columns: the same blocks as one rank's."""
    model_dir = tiny_model_dir("llama")
    common = {"backend": "template", "dtype": "float32", "quantization": "int4"}
    one, _ = generate(model_dir, **common)
    two, runner = generate(model_dir, tensor_parallel_size=2, **common)
    assert runner.quantization == "quantized Q4_1 x 8, Q8_0 x 2"
    assert_same(two, one)
