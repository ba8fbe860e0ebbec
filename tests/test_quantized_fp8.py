"""FP8 weights (issue #25): float8 e4m3 with a float32 scale per output row.

The format's decoding against torch's own float8, quantizing 16/32-bit weights at load time,
whole tiny models quantized in the test (through the reference op, on the CPU backend, under
tensor parallelism), which ops declare an FP8 kernel, and the refusals. Checkpoints stored in
FP8: ``test_fp8_checkpoint.py``; the GPU backends' Triton kernel: ``test_fp8_triton.py``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from quantized_models import (
    LINEARS_PER_MODEL,
    PROMPTS,
    assert_same,
    fp8_exact_copy,
    generate,
)
from safetensors.torch import load_file, save_file

from platform_core import LLM, SamplingParams
from platform_core.errors import ConfigError, ModelLoadError
from platform_core.quantization.formats import (
    FP8_E4M3,
    FP8_MAX,
    Q8_0,
    dequantize,
    fp8_rows,
    has_kernel,
    quantize,
    quantized_linear,
)


def test_every_e4m3_code_decodes_as_torch_does():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    rows = fp8_rows(codes.view(torch.float8_e4m3fn).unsqueeze(0), torch.tensor(1.0))
    ours = dequantize(rows, FP8_E4M3)[0]
    theirs = codes.view(torch.float8_e4m3fn).float()
    assert ours.isnan().tolist() == theirs.isnan().tolist()
    assert torch.equal(ours.nan_to_num(0.0), theirs.nan_to_num(0.0))


def test_row_scales_decode_exactly():
    """float32 scales from subnormal to huge, one per row, times the code for 1.0."""
    scales = torch.tensor([1e-42, 2.5e-39, 3.1e-20, 1 / 448, 0.0, 1.0, 7.25, 3.0e38])
    one = torch.ones(len(scales), 3).to(torch.float8_e4m3fn)
    rows = fp8_rows(one, scales.unsqueeze(1))
    assert rows.shape == (len(scales), 4 + 3) and rows.dtype == torch.uint8
    assert torch.equal(dequantize(rows, FP8_E4M3), scales.unsqueeze(1).expand(-1, 3))
    # a per-tensor scale is the same scale in every row
    assert torch.equal(dequantize(fp8_rows(one, torch.tensor(2.0)), FP8_E4M3), 2 * one.float())


def test_quantizing_scales_each_row_by_its_largest_weight_and_rounds_to_nearest():
    weights = torch.randn(6, 300) * torch.logspace(-3, 2, 6).unsqueeze(1)
    weights[2] = 0.0
    rows = quantize(weights, FP8_E4M3)
    restored = dequantize(rows, FP8_E4M3)
    expected_scale = weights.abs().amax(1, keepdim=True) / FP8_MAX
    codes = (weights / expected_scale.clamp_min(1e-30)).to(torch.float8_e4m3fn).float()
    torch.testing.assert_close(restored, codes * expected_scale, rtol=1e-6, atol=0.0)
    assert torch.equal(restored[2], torch.zeros(300))
    # e4m3 keeps 3 mantissa bits: within 2^-4 of each weight with a normal code (>= 2^-6)
    big = weights.abs() >= expected_scale * 2**-6
    assert ((restored - weights).abs()[big] <= weights.abs()[big] * 2**-4).all()
    # a column shard keeps the whole row's scale: the same bytes as the whole row's columns
    shard = quantize(weights, FP8_E4M3, slice(100, 250))
    assert torch.equal(shard[:, :4], rows[:, :4])
    assert torch.equal(shard[:, 4:], rows[:, 104:254])


def test_the_reference_op_keeps_the_input_dtype_and_adds_the_bias():
    rows = quantize(torch.randn(5, 40), FP8_E4M3)
    x, bias = torch.randn(3, 40), torch.randn(5)
    expected = x @ dequantize(rows, FP8_E4M3).T + bias
    torch.testing.assert_close(quantized_linear(x, rows, FP8_E4M3, bias), expected)
    assert quantized_linear(x.bfloat16(), rows, FP8_E4M3, None).dtype == torch.bfloat16


def test_non_finite_weights_are_refused():
    weights = torch.randn(4, 8)
    weights[1, 3] = torch.inf
    with pytest.raises(ValueError, match="finite"):
        quantize(weights, FP8_E4M3)


@pytest.fixture(scope="module")
def fp8_model(tiny_model_dir, tmp_path_factory) -> Path:
    return fp8_exact_copy(tiny_model_dir("llama"), tmp_path_factory.mktemp("fp8") / "m")


def test_a_model_quantized_to_fp8_gives_the_dense_models_tokens(fp8_model, caplog):
    """Through the reference op (the template backend has no quantized_linear of its own)."""
    common = {"backend": "template", "dtype": "float32"}
    with caplog.at_level(logging.INFO, logger="platform_core.models"):
        quantized, runner = generate(fp8_model, quantization="fp8", **common)
    assert runner.quantization == f"quantized FP8_E4M3 x {LINEARS_PER_MODEL}"
    assert "the FP8_E4M3 layers run the core's reference op" in caplog.text
    dense, dense_runner = generate(fp8_model, **common)
    assert dense_runner.quantization is None
    assert runner.weights_bytes < dense_runner.weights_bytes
    assert runner.parameter_count == dense_runner.parameter_count
    assert_same(quantized, dense)


def test_the_cpu_backend_runs_fp8_through_the_reference_op_and_says_so(fp8_model, caplog):
    """Its one-token steps are traced, so the op's decoding of the bytes must trace too."""
    common = {"backend": "cpu", "dtype": "float32"}
    with caplog.at_level(logging.INFO, logger="platform_core.models"):
        quantized, runner = generate(fp8_model, quantization="fp8", **common)
    assert runner.quantization == f"quantized FP8_E4M3 x {LINEARS_PER_MODEL}"
    assert "the FP8_E4M3 layers run the core's reference op" in caplog.text
    assert_same(quantized, generate(fp8_model, **common)[0], atol=1e-3)


def test_an_op_names_the_formats_it_has_kernels_for():
    def op(x, qweight, fmt, bias):
        raise AssertionError("never called")

    assert not has_kernel(None, FP8_E4M3) and not has_kernel(quantized_linear, FP8_E4M3)
    # one that names none has the GGML block formats' kernels (written before FP8 joined)
    assert has_kernel(op, Q8_0) and not has_kernel(op, FP8_E4M3)
    op.kernel_formats = frozenset({"FP8_E4M3"})
    assert has_kernel(op, FP8_E4M3) and not has_kernel(op, Q8_0)


def test_a_16_bit_checkpoint_quantized_to_fp8_rates_its_tokens_like_the_float_model(
    tiny_model_dir,
):
    """The first token of each prompt is one the float model rates near its own best (e4m3
    keeps 3 mantissa bits: looser than int8's bound, tighter than int4's)."""
    model_dir = tiny_model_dir("llama")
    first = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    prompts = [{"prompt_token_ids": p} for p in [*PROMPTS, [7, 8], [200] * 9]]

    def run(**kwargs):
        with LLM(str(model_dir), backend="template", dtype="float32", **kwargs) as llm:
            return [o.outputs[0] for o in llm.generate(prompts, first, use_tqdm=False)]

    for ours, theirs in zip(run(quantization="fp8"), run(), strict=True):
        token = ours.token_ids[0]
        assert token in theirs.logprobs[0]
        assert abs(theirs.logprobs[0][token].logprob - ours.logprobs[0][token].logprob) < 0.15


def test_tensor_parallel_ranks_quantize_their_shards_and_give_one_rank_tokens(tiny_model_dir):
    """Row shards take their rows' scales; column shards (o_proj, down_proj) the whole row's,
    so two ranks hold exactly the weights one rank does."""
    model_dir = tiny_model_dir("llama")
    common = {"backend": "template", "dtype": "float32", "quantization": "fp8"}
    one, _ = generate(model_dir, **common)
    two, runner = generate(model_dir, tensor_parallel_size=2, **common)
    assert runner.quantization == f"quantized FP8_E4M3 x {LINEARS_PER_MODEL}"
    assert_same(two, one)


def test_bad_input_is_refused_with_a_typed_error(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="quantization='fp4' is not supported"):
        LLM(str(tiny_model_dir("llama")), quantization="fp4")
    broken = fp8_exact_copy(tiny_model_dir("llama"), tmp_path / "inf")
    tensors = load_file(broken / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = torch.inf
    save_file(tensors, broken / "model.safetensors", {"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.down_proj.*finite"):
        LLM(str(broken), backend="template", quantization="fp8")
