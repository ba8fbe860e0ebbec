"""The CPU backend's fused RMS norm, SiLU-and-multiply and rotary against the core's default
ops. They round where the unfused ops round, so bfloat16 results are equal except for rare
last-bit differences (a float32 intermediate landing on the other side of a rounding tie);
float32 results agree within a few float32 roundings. Each check runs on the build of every ISA
level this CPU runs."""

from __future__ import annotations

import pytest
import torch

from platform_core.layers.activation import silu_and_mul
from platform_core.layers.norm import rms_norm
from platform_core.layers.rotary import apply_rotary

kernels = pytest.importorskip("platform_core_cpu.kernels", reason="pip install -e backends/cpu")
from platform_core_cpu.isa import host_isa  # noqa: E402
from platform_core_cpu.layer_ops import fused_layer_ops  # noqa: E402
from platform_core_cpu.plugin import CpuBackend  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", params=host_isa().supported)
def fused(request):
    build = kernels.load_kernels(request.param)
    assert build.ops is not None, f"the {request.param} kernels must build here: {build.reason}"
    return fused_layer_ops(build.ops)


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    if want.dtype != torch.bfloat16:
        torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
        return
    torch.testing.assert_close(got, want, atol=1e-30, rtol=2**-7)  # one bf16 step at most
    assert (got != want).float().mean().item() < 1e-3  # and rarely that


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 37, 300])  # 300 rows of 576 split across threads
def test_rms_norm_matches_the_default(fused, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
    weight = torch.randn(576, generator=gen).to(dtype)
    before = x.clone()
    assert_matches(fused["rms_norm"](x, weight, 1e-5), rms_norm(x, weight, 1e-5))
    assert torch.equal(x, before)
    heads = x[:, :512].reshape(rows, 8, 64)  # per-head q/k norms (3-D)
    assert_matches(fused["rms_norm"](heads, weight[:64], 1e-6), rms_norm(heads, weight[:64], 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1408, 70])  # 70: a tail shorter than one vector
def test_silu_and_mul_matches_the_default(fused, dtype, width):
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(33, 2 * width, generator=gen) * 4).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp over- and underflow
    assert_matches(fused["silu_and_mul"](x), silu_and_mul(x))


def _rotary_inputs(dtype, gen):
    qkv = torch.randn(29, (8 + 4 + 4) * 64, generator=gen).to(dtype)
    positions = torch.randint(0, 4096, (29,), generator=gen)
    angles = torch.outer(positions.float(), 10000.0 ** (-torch.arange(0, 64, 2) / 64))
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype)
    cos, sin = cos_sin.chunk(2, dim=-1)
    return qkv, cos, sin


def _heads(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = qkv.split([512, 256, 256], dim=-1)
    return q.view(-1, 8, 64), k.view(-1, 4, 64), v


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_rotates_the_fused_qkv_views_in_place(fused, dtype):
    qkv, cos, sin = _rotary_inputs(dtype, torch.Generator().manual_seed(0))
    want_q, want_k = apply_rotary(*_heads(qkv)[:2], cos, sin)
    rotated = qkv.clone()
    q, k, v = _heads(rotated)
    got_q, got_k = fused["rotary"](q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    assert_matches(got_q, want_q)
    assert_matches(got_k, want_k)
    assert torch.equal(v, _heads(qkv)[2])  # values untouched


def test_unsupported_inputs_take_the_default_ops(fused):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 32, generator=gen, dtype=torch.float64)
    weight = torch.randn(32, generator=gen, dtype=torch.float64)
    assert_matches(fused["rms_norm"](x, weight, 1e-5), rms_norm(x, weight, 1e-5))
    columns = torch.randn(64, 8, generator=gen).t()  # rows are not contiguous
    assert_matches(fused["silu_and_mul"](columns), silu_and_mul(columns))
    qkv, cos, sin = _rotary_inputs(torch.float32, gen)
    q, k, _ = _heads(qkv)
    mixed = fused["rotary"](q, k, cos.double(), sin.double())
    assert_matches(mixed[0], apply_rotary(q, k, cos.double(), sin.double())[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_argmax_answers_as_torch_does(fused, dtype):
    gen = torch.Generator().manual_seed(3)
    for shape in [(256, 32000), (3, 7), (5, 16), (2, 49153), (4, 1000)]:
        x = torch.randn(shape, generator=gen).to(dtype)  # bf16: many ties
        assert torch.equal(fused["argmax"](x), x.argmax(dim=-1))
    # Rows of 40 are all tail; rows of 1000 are three 256-element chunks and a tail.
    for width in (40, 1000):
        x = torch.randn(9, width, generator=gen)
        x[0] = float("-inf")  # all equal: the first index
        x[1, 5] = x[1, 30] = 100.0  # a tie: the first one
        x[2, 7] = x[2, 3] = float("nan")  # NaN counts as maximal: the first NaN
        x[3, width - 2] = float("nan")  # in the tail
        x[4] = 1.0
        x[5, 17] = x[5, 33] = float("inf")
        x[6, width - 1] = 1e30  # the maximum in the tail
        x[7, width - 3] = x[7, 20] = 50.0  # tied between a chunk and the tail
        x[8, 600 % width] = x[8, 300 % width] = 70.0  # tied across two chunks
        x = x.to(dtype)
        assert torch.equal(fused["argmax"](x), x.argmax(dim=-1))
    half = x.to(torch.float16)  # other dtypes: torch's argmax
    assert torch.equal(fused["argmax"](half), half.argmax(dim=-1))


FUSED = {"rms_norm", "silu_and_mul", "rotary", "argmax"}


def test_backend_offers_the_fused_ops_unless_on_the_torch_path(monkeypatch):
    assert set(CpuBackend().op_overrides()) >= FUSED
    monkeypatch.setenv("PLATFORM_CORE_CPU_KERNEL", "torch")
    assert not FUSED & set(CpuBackend().op_overrides())
