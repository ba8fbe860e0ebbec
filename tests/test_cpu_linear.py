"""The CPU backend's bf16 linear against ``F.linear``: the compiled ``linear_bf16`` in the build
of every ISA level this CPU runs (widened weights; AVX512-BF16 dot products for one row where
the build has them), the oneDNN packed path and its weight cache, and which path each
CPU level routes to."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from platform_core_cpu.isa import host_isa, resolve_isa
from platform_core_cpu.kernels import load_kernels
from platform_core_cpu.linear import CpuLinear, packed_linear_available
from platform_core_cpu.plugin import CpuBackend

from platform_core.layers.ops import resolve_ops

LEVELS = host_isa().supported
needs_onednn = pytest.mark.skipif(
    not (host_isa().onednn_bf16 and packed_linear_available()),
    reason="oneDNN computes bf16 only on CPUs with AVX-512 or AVX-NE-CONVERT",
)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def _kernel(level: str):
    build = load_kernels(level)
    assert build.ops is not None, f"the {level} kernels must build here: {build.reason}"
    return build.ops


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(
    ("rows", "n", "k"),
    # One row (decode); 2-5 rows (tile remainders); 32 (the last tiled size) and 33, 77 (widened
    # chunks through torch's matmul); odd N and K off every vector width.
    [
        (1, 96, 64),
        (1, 97, 70),
        (1, 5, 1536),
        (1, 2816, 512),
        (2, 33, 200),
        (3, 960, 576),
        (5, 97, 70),
        (32, 301, 130),
        (33, 96, 64),
        (77, 1000, 576),
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_compiled_linear_matches_f_linear(
    level: str, rows: int, n: int, k: int, bias: bool
) -> None:
    gen = torch.Generator().manual_seed(rows * n * k)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    got = _kernel(level).linear_bf16(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # fp32 sums rounded once to bf16: within one bf16 step of the exact result.
    torch.testing.assert_close(got.float(), want, atol=1e-2 * want.abs().max().item(), rtol=2**-7)


@pytest.mark.parametrize("level", LEVELS)
def test_compiled_linear_reads_strided_rows_and_empty_batches(level: str) -> None:
    ops = _kernel(level)
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(40, 24, generator=gen).to(torch.bfloat16)
    wide = torch.randn(6, 64, generator=gen).to(torch.bfloat16)
    x = wide[:, 8:32]  # rows 64 apart: a slice of a fused projection
    _close(ops.linear_bf16(x, w, None), F.linear(x.float(), w.float()))
    assert ops.linear_bf16(wide[:0, :24], w, None).shape == (0, 40)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.linear_bf16(x.float(), w.float(), None)


@pytest.mark.parametrize("level", LEVELS)
def test_backend_linear_at_each_level_routes_and_matches(level: str) -> None:
    """What a CPU of each level runs: bf16 linears of any batch shape agree with F.linear."""
    backend = CpuBackend(resolve_isa(host_isa().flags, level))
    linear = resolve_ops(backend.op_overrides()).linear
    assert isinstance(linear, CpuLinear)
    assert ("oneDNN" in linear.path) == backend.isa.onednn_bf16
    assert "compiled" in linear.path  # one row (batch-1 decode) at least: the compiled GEMV
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(96, 64, generator=gen).to(torch.bfloat16)
    b = torch.randn(96, generator=gen).to(torch.bfloat16)
    for shape in [(1, 64), (4, 64), (2, 3, 64), (1, 40, 64)]:
        x = torch.randn(shape, generator=gen).to(torch.bfloat16)
        got = linear(x, w, b)
        assert got.shape == (*shape[:-1], 96)
        _close(got, F.linear(x.float(), w.float(), b.float()))
    xt = torch.randn(64, 5, generator=gen).to(torch.bfloat16).t()  # columns contiguous
    _close(linear(xt, w), F.linear(xt.float(), w.float()))
    for rows in (1, 4, 40):  # float32: packed for oneDNN where the build has it
        x32, w32 = torch.randn(rows, 64, generator=gen), torch.randn(8, 64, generator=gen)
        b32 = torch.randn(8, generator=gen)
        torch.testing.assert_close(linear(x32, w32, b32), F.linear(x32, w32, b32))


def test_one_row_goes_to_the_kernel_on_every_path() -> None:
    calls = []
    ops = _kernel(LEVELS[-1])

    def counting(x, weight, bias):
        calls.append(x.shape[0])
        return ops.linear_bf16(x, weight, bias)

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=gen).to(torch.bfloat16)
    one, many = (torch.randn(rows, 32, generator=gen).to(torch.bfloat16) for rows in (1, 4))
    widened = CpuLinear(counting, onednn=False)
    _close(widened(one, w), F.linear(one, w))
    _close(widened(many, w), F.linear(many, w))
    assert calls == [1, 4]
    if host_isa().onednn_bf16 and packed_linear_available():
        calls.clear()
        packed = CpuLinear(counting, onednn=True)  # oneDNN takes only several rows
        _close(packed(one, w), F.linear(one, w))
        _close(packed(many, w), F.linear(many, w))
        assert calls == [1]


@needs_onednn
@pytest.mark.parametrize("batch", [1, 3, 32, 77])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_matches_f_linear_bf16(batch: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(batch)
    w = torch.randn(96, 64, generator=gen).to(torch.bfloat16)
    b = torch.randn(96, generator=gen).to(torch.bfloat16) if bias else None
    x = torch.randn(batch, 64, generator=gen).to(torch.bfloat16)
    linear = CpuLinear(None, onednn=True)
    _close(linear(x, w, b), F.linear(x, w, b))
    # A 3-D and a non-contiguous input give the same rows.
    _close(linear(x.view(1, batch, 64), w, b)[0], F.linear(x, w, b))
    xt = x.t().contiguous().t()
    _close(linear(xt, w, b), F.linear(x, w, b))


@pytest.mark.skipif(not packed_linear_available(), reason="this torch build has no oneDNN")
@pytest.mark.parametrize("rows", [1, 3, 77])
def test_packed_float32_matches_f_linear(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    w, b = torch.randn(97, 70, generator=gen), torch.randn(97, generator=gen)
    x = torch.randn(rows, 70, generator=gen)
    linear = CpuLinear(None, onednn=False, onednn_float32=True)
    torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b))
    torch.testing.assert_close(linear(x.view(1, rows, 70), w)[0], F.linear(x, w))
    assert len(linear._cache) == 1


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_in_place_weight_update_repacks(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(32, 16, generator=gen).to(dtype)
    x = torch.randn(5, 16, generator=gen).to(dtype)
    linear = CpuLinear(None, onednn=True, onednn_float32=True)
    linear(x, w)
    with torch.no_grad():
        w.copy_(torch.randn(32, 16, generator=gen).to(dtype))
    _close(linear(x, w), F.linear(x, w))


@needs_onednn
def test_cache_entry_dies_with_its_weight() -> None:
    linear = CpuLinear(None, onednn=True)
    x = torch.ones(2, 8, dtype=torch.bfloat16)
    w = torch.ones(4, 8, dtype=torch.bfloat16)
    linear(x, w)
    assert len(linear._cache) == 1
    del w
    gc.collect()
    assert linear._cache == {}
