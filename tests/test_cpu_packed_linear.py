"""CPU backend packed bf16 linear against ``F.linear``, and its weight cache's invalidation."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from platform_core_cpu.linear import PackedLinear, packed_linear_available
from platform_core_cpu.plugin import CpuBackend

from platform_core.layers.ops import resolve_ops

pytestmark = pytest.mark.skipif(
    not packed_linear_available(), reason="this torch build has no oneDNN packed linear"
)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("batch", [1, 3, 32, 77])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear_bf16(batch: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(batch)
    w = torch.randn(96, 64, generator=gen).to(torch.bfloat16)
    b = torch.randn(96, generator=gen).to(torch.bfloat16) if bias else None
    x = torch.randn(batch, 64, generator=gen).to(torch.bfloat16)
    linear = PackedLinear()
    _close(linear(x, w, b), F.linear(x, w, b))
    # A 3-D and a non-contiguous input give the same rows.
    _close(linear(x.view(1, batch, 64), w, b)[0], F.linear(x, w, b))
    xt = x.t().contiguous().t()
    _close(linear(xt, w, b), F.linear(x, w, b))


def test_float32_is_exactly_f_linear() -> None:
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(16, 8, generator=gen), torch.randn(4, 8, generator=gen)
    assert torch.equal(PackedLinear()(x, w, None), F.linear(x, w))


def test_in_place_weight_update_repacks() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(32, 16, generator=gen).to(torch.bfloat16)
    x = torch.randn(5, 16, generator=gen).to(torch.bfloat16)
    linear = PackedLinear()
    linear(x, w)
    with torch.no_grad():
        w.copy_(torch.randn(32, 16, generator=gen).to(torch.bfloat16))
    _close(linear(x, w), F.linear(x, w))


def test_cache_entry_dies_with_its_weight() -> None:
    linear = PackedLinear()
    x = torch.ones(2, 8, dtype=torch.bfloat16)
    w = torch.ones(4, 8, dtype=torch.bfloat16)
    linear(x, w)
    assert len(linear._cache) == 1
    del w
    gc.collect()
    assert linear._cache == {}


def test_backend_overrides_the_linear_op() -> None:
    ops = resolve_ops(CpuBackend().op_overrides())
    assert isinstance(ops.linear, PackedLinear)


def _gemv():
    from platform_core_cpu.kernels import load_kernels

    ops = load_kernels().ops
    if ops is None or not ops.gemv_supported():
        pytest.skip("the compiled GEMV needs the CPU kernels and AVX512-BF16")
    return ops.gemv_bf16


@pytest.mark.parametrize(
    ("n", "k"), [(96, 64), (97, 70), (5, 1536), (2816, 512), (960, 576), (33, 200)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_compiled_gemv_matches_f_linear(n: int, k: int, bias: bool) -> None:
    gemv = _gemv()
    gen = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    got = gemv(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (1, n)
    torch.testing.assert_close(got.float(), want, atol=2e-2 * want.abs().max().item(), rtol=1e-2)


def test_one_row_goes_to_the_gemv_and_more_rows_to_onednn() -> None:
    gemv = _gemv()
    calls = []

    def counting(x, weight, bias):
        calls.append(x.shape[0])
        return gemv(x, weight, bias)

    linear = PackedLinear(counting)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=gen).to(torch.bfloat16)
    one, many = (torch.randn(rows, 32, generator=gen).to(torch.bfloat16) for rows in (1, 4))
    _close(linear(one, w), F.linear(one, w))
    _close(linear(many, w), F.linear(many, w))
    assert calls == [1]
