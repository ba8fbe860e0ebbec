"""The CPU backend's compiled ``quantized_linear`` in the build of every ISA level this CPU runs
(generic, AVX2, AVX-512, AVX-512 with VNNI; lower levels forced as ``PLATFORM_CORE_CPU_ISA``
does), per block format, against the core's reference op.

Up to 32 rows the kernel rounds each 32 activations to 8 bits (16 for Q8_0) and takes integer
dot products:
its output must equal the reference applied to activations rounded the same way (to float
rounding of the sums), and stay within 1% relative RMS of the exact reference (the conformance
floor; checked where there are enough outputs for a stable RMS). More rows dequantize the
weights: on AVX512-BF16 builds with bf16 activations a panel of rows at a time into bf16 dot
products, else into torch's float32 matmul; close to the reference itself.
"""

from __future__ import annotations

import pytest
import torch
from platform_core_cpu.isa import ISA_ENV, host_isa
from platform_core_cpu.kernels import load_kernels
from platform_core_cpu.plugin import CpuBackend, describe_paths
from platform_core_cpu.quantized_linear import compiled_quantized_linear

from platform_core.backend_api import QUANT_FORMATS, QuantFormat, quantized_linear, random_blocks

LEVELS = host_isa().supported


def integer_rows_max(level: str, dtype: torch.dtype) -> int:
    """The most rows the kernel takes integer dot products for (beyond: dequantized weights,
    in bf16 panels for bf16 activations on AVX512-BF16 builds)."""
    return 5 if level == "avx512_bf16" and dtype == torch.bfloat16 else 16


def _ops(level: str):
    build = load_kernels(level)
    assert build.ops is not None, f"the {level} kernels must build here: {build.reason}"
    return build.ops


def rounded_like_the_kernel(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x`` with each 32 values rounded to ``d * q``: ``d = max|x| / L``, ``q`` an integer, with
    ``L`` 32767 (16 bits) for Q8_0 weights and 127 (8 bits) for the others."""
    largest = 32767.0 if fmt == "Q8_0" else 127.0
    blocks = x.float().unflatten(-1, (-1, 32))
    peak = blocks.abs().amax(-1, keepdim=True)
    # A true division, as the kernel's (``127.0 / tensor`` multiplies by a reciprocal: an ulp
    # away at times, and then a value at a rounding tie rounds the other way).
    inverse = torch.where(peak > 0, torch.full_like(peak, largest) / peak, torch.zeros_like(peak))
    return (torch.round(blocks * inverse) * (peak / largest)).flatten(-2)


def _relative_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()


def _case(fmt: QuantFormat, rows: int, n: int, blocks: int, dtype: torch.dtype, bias: bool):
    gen = torch.Generator().manual_seed(rows * 1000 + n + blocks)
    k = blocks * fmt.block_size
    weight = random_blocks(n, k, fmt, 0.05, gen)
    x = (torch.randn(rows, k, generator=gen) * 2).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, weight, b


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", sorted(QUANT_FORMATS))
@pytest.mark.parametrize(
    ("rows", "n", "blocks"),
    # One row (four weight rows per tile, and the remainder); 2-5 rows (tiles of two weight rows
    # by up to five x rows, and their remainders); 6, 11 and 16 rows (tiles of 3 + 3, 4 + 4 + 3
    # and 4 x 4); 8 and 16 (the last integer sizes) and 9, 17
    # and 77 (the dequantized matmul: 16-row vectors of x, up to three per tile); weight rows
    # off every tile and vector width, and 150 (bf16 panels of several 8-row tiles, the last
    # one short); 9 32-weight blocks (one more than an 8-block scale conversion) and 3.
    [
        (1, 37, 9),
        (1, 8, 3),
        (2, 5, 9),
        (3, 33, 3),
        (5, 97, 9),
        (6, 21, 9),
        (11, 13, 3),
        (8, 19, 3),
        (9, 12, 3),
        (16, 19, 3),
        (17, 40, 3),
        (77, 9, 9),
        (50, 150, 3),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_reference(level, name, rows, n, blocks, dtype):
    fmt = QUANT_FORMATS[name]
    if fmt.block_size == 256 and blocks == 9:
        blocks = 2  # 512 weights a row; K-quant rows are 256 apiece
    x, weight, bias = _case(fmt, rows, n, blocks, dtype, bias=rows % 2 == 1)
    got = _ops(level).quantized_linear(x, weight, name, bias)
    assert got.dtype == dtype and got.shape == (rows, n)
    bias_f = None if bias is None else bias.float()
    exact = quantized_linear(x.float(), weight, fmt, bias_f)
    if rows * n >= 64:  # enough outputs for the RMS to be a stable measure
        assert _relative_rms(got, exact) < 0.01
    if rows <= integer_rows_max(level, dtype):
        want = quantized_linear(rounded_like_the_kernel(x, name), weight, fmt, bias_f)
    else:
        want = exact
    # the output's own rounding (and, for a bf16 matmul, the dequantized weights')
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-4
    scale = want.abs().max().item()
    torch.testing.assert_close(got.float(), want, atol=tolerance * scale, rtol=tolerance)


@pytest.mark.parametrize("level", LEVELS)
def test_every_level_gives_the_same_integer_sums(level):
    """The levels differ only in the order float sums are added: their outputs agree to float
    rounding, whatever instruction computed the integer dot products."""
    fmt = QUANT_FORMATS["Q6_K"]  # 16-weight scales: both halves of each part's lanes matter
    x, weight, _ = _case(fmt, 3, 64, 4, torch.float32, bias=False)
    base = _ops("generic").quantized_linear(x, weight, "Q6_K", None)
    got = _ops(level).quantized_linear(x, weight, "Q6_K", None)
    torch.testing.assert_close(got, base, atol=1e-4 * base.abs().max().item(), rtol=1e-5)


def test_zero_rows_and_a_zero_block():
    ops = _ops(LEVELS[-1])
    fmt = QUANT_FORMATS["Q4_1"]
    weight = random_blocks(6, 64, fmt, 0.05, torch.Generator().manual_seed(0))
    assert ops.quantized_linear(torch.zeros(0, 64), weight, "Q4_1", None).shape == (0, 6)
    x = torch.randn(1, 64)
    x[0, :32] = 0.0  # a block of zeros has no scale to divide by
    want = quantized_linear(x, weight, fmt, None)
    torch.testing.assert_close(
        ops.quantized_linear(x, weight, "Q4_1", None),
        want,
        atol=0.02 * want.abs().max().item(),
        rtol=0.02,
    )


def test_bad_input_is_refused_with_a_clear_error():
    ops = _ops(LEVELS[-1])
    weight = random_blocks(4, 64, QUANT_FORMATS["Q8_0"], 0.05, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="no kernel for format Q5_0"):
        ops.quantized_linear(torch.randn(1, 64), weight, "Q5_0", None)
    with pytest.raises(RuntimeError, match="do not hold 96 weights"):
        ops.quantized_linear(torch.randn(1, 96), weight, "Q8_0", None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 x"):
        ops.quantized_linear(torch.randn(1, 64, dtype=torch.float64), weight, "Q8_0", None)


@pytest.mark.parametrize("level", LEVELS)
def test_rows_of_x_with_a_stride_past_their_length(level):
    """x's rows may sit further apart than their length (a slice of wider rows): every path
    reads each row from its own start."""
    fmt = QUANT_FORMATS["Q4_1"]
    gen = torch.Generator().manual_seed(3)
    weight = random_blocks(24, 64, fmt, 0.05, gen)
    for rows in (3, 40):
        wide = torch.randn(rows, 96, generator=gen).bfloat16()
        x = wide[:, :64]
        assert x.stride(0) == 96
        got = _ops(level).quantized_linear(x, weight, "Q4_1", None)
        torch.testing.assert_close(
            got, _ops(level).quantized_linear(x.contiguous(), weight, "Q4_1", None)
        )
        assert _relative_rms(got, quantized_linear(x.float(), weight, fmt, None)) < 0.01


def test_the_override_routes_what_the_kernel_cannot_take_to_the_reference():
    op = compiled_quantized_linear(_ops(LEVELS[-1]))
    fmt = QUANT_FORMATS["Q4_0"]
    weight = random_blocks(8, 64, fmt, 0.05, torch.Generator().manual_seed(1))
    x = torch.randn(2, 3, 128)[..., ::2]  # batch dimensions, rows with a stride
    want = quantized_linear(x, weight, fmt, None)
    got = op(x, weight, fmt, None)
    assert got.shape == (2, 3, 8) and _relative_rms(got, want) < 0.01
    half = x.half()  # no kernel for float16: the reference op, exactly
    torch.testing.assert_close(
        op(half, weight, fmt, None), quantized_linear(half, weight, fmt, None)
    )


@pytest.mark.parametrize("level", LEVELS)
def test_the_backend_overrides_quantized_linear_at_every_level(monkeypatch, level):
    monkeypatch.setenv(ISA_ENV, level)
    backend = CpuBackend()
    assert "quantized_linear" in backend.op_overrides()
    paths = "\n".join(describe_paths(backend.isa))
    integer_dots = (
        "VNNI"
        if backend.isa.at_least("avx512_bf16")
        else ("AVX2" if backend.isa.at_least("avx2") else "plain loops")
    )
    assert f"quantized linears: integer dot products ({integer_dots})" in paths


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_activation_gives_nan_outputs_as_the_reference(level, bad):
    fmt = QUANT_FORMATS["Q4_1"]
    weight = random_blocks(5, 64, fmt, 0.05, torch.Generator().manual_seed(2))
    x = torch.randn(2, 64)
    x[0, 40] = bad  # row 0's second block; row 1 stays finite
    got = _ops(level).quantized_linear(x, weight, "Q4_1", None)
    assert torch.isnan(got[0]).all()
    want = quantized_linear(x[1:], weight, fmt, None)
    assert _relative_rms(got[1:], want) < 0.02
