"""Whole models on GGUF blocks through the CPU backend's compiled ``quantized_linear``, at every
ISA level this CPU runs, against the same engine with that op replaced by the core's reference
op applied to activations rounded as the kernel rounds them.

Up to 16 rows the kernel rounds each 32 activations to 8 bits, 16 for Q8_0 (about 0.5% of a
4-bit linear's output RMS). A tiny random model's flat logits amplify that into other greedy
tokens, so the reference rounds the activations the same way; then both compute the same sums,
and the tokens must be the same and the logprobs equal but for a rare rounding tie. This checks
the kernel inside the engine (fused projections, chunked prefill, batched decode, the traced
one-token step) per format. The default model's quantized answers are checked in
tests/test_default_model.py.
"""

from __future__ import annotations

import os

import gguf
import pytest
from gguf_utils import write_tiny_gguf
from platform_core_cpu import quantized_linear as cpu_quantized_linear
from platform_core_cpu.isa import ISA_ENV, host_isa
from quantized_models import assert_same, generate
from test_cpu_quantized_linear import integer_rows_max, rounded_like_the_kernel
from test_quantized_gguf import _summary

from platform_core.backend_api import quantized_linear
from platform_core.models.gguf_loader import materialize_gguf

GGML = gguf.GGMLQuantizationType
FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
SHAPES = {name: {"ffn": 128} for name in ("Q8_0", "Q4_0", "Q4_1")} | {
    name: {"hidden": 256, "ffn": 512}
    for name in ("Q4_K", "Q6_K")  # rows of 256 weights
}
# The two sum in different orders, so an activation at a rounding tie may round one step apart
# in one of them (seen: 0.008 once); unmatched rounding moves logprobs by 0.02-0.5 and tokens.
LOGPROB_ATOL = 0.02


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """One tiny GGUF per format, every linear in it (embedding Q8_0), materialized once."""
    root = tmp_path_factory.mktemp("quantized-models")
    return {
        name: materialize_gguf(
            write_tiny_gguf(root / f"{name}.gguf", qtype=GGML[name], **SHAPES.get(name, {})),
            root / "cache",  # the kernel builds stay in the shared cache
        )
        for name in FORMATS
    }


def _reference_on_rounded_activations(_ops):
    """The reference op on activations rounded as the kernel rounds them (where it takes
    integer dot products)."""

    def op(x, qweight, fmt, bias):
        rows = x.reshape(-1, x.shape[-1]).shape[0]
        if rows <= integer_rows_max(os.environ[ISA_ENV], x.dtype):
            x = rounded_like_the_kernel(x, fmt.name).to(x.dtype)
        return quantized_linear(x, qweight, fmt, bias)

    return op


@pytest.mark.parametrize("level", host_isa().supported)
@pytest.mark.parametrize("name", FORMATS)
def test_a_model_on_blocks_computes_what_the_reference_op_does(models, monkeypatch, level, name):
    monkeypatch.setenv(ISA_ENV, level)
    common = {"backend": "cpu", "dtype": "float32", "quantization": "gguf"}
    outputs, runner = generate(models[name], **common)
    assert runner.quantization == _summary(name)
    with monkeypatch.context() as patch:
        patch.setattr(
            cpu_quantized_linear, "compiled_quantized_linear", _reference_on_rounded_activations
        )
        reference, _ = generate(models[name], **common)
    assert_same(outputs, reference, atol=LOGPROB_ATOL)


def test_the_cpu_backend_keeps_the_blocks_unless_a_dtype_is_asked_for(models):
    # Its own quantized_linear: quantization auto keeps the blocks (activations in the auto
    # dtype); a dtype asked for dequantizes them once at load.
    assert generate(models["Q4_1"], backend="cpu")[1].quantization == _summary("Q4_1")
    assert generate(models["Q4_1"], backend="cpu", dtype="bfloat16")[1].quantization is None
