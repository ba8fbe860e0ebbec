"""The ``lora_shrink`` and ``lora_expand`` ops: the core's reference against a per-token gather
and einsum, the CPU backend's path (slot groups, GEMMs in the model's dtype) and the GPU
backends' Triton kernels (under the interpreter, in a child process: this file run as a script,
as ``test_token_bitmask.py`` does) against the reference, and the edge cases of the contract.

The CPU backend has two paths: its compiled kernels (``csrc/lora.cpp``), checked here on the
build of every ISA level this CPU runs, and torch ops over slot groups (oneDNN/BLAS GEMMs), which
it runs where the kernels are not built or take not the dtypes."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, replace

import pytest
import torch
from json_child import collect, start_child

from platform_core.kernels.triton import triton_installed
from platform_core.layers.lora import LoRAMapping, LoRASegment, lora_expand, lora_shrink
from platform_core.layers.ops import OVERRIDABLE_OPS, LayerOps, resolve_ops

SLOTS = 4


def mapping_of(slots: list[int]) -> LoRAMapping:
    """``slots`` with their segments (maximal runs of one slot other than -1)."""
    segments: list[LoRASegment] = []
    for token, slot in enumerate(slots):
        if slot < 0:
            continue
        if segments and segments[-1].end == token and segments[-1].slot == slot:
            segments[-1] = LoRASegment(segments[-1].start, token + 1, slot)
        else:
            segments.append(LoRASegment(token, token + 1, slot))
    return LoRAMapping(torch.tensor(slots, dtype=torch.int32), tuple(segments), SLOTS)


@dataclass(frozen=True)
class Case:
    x: torch.Tensor  # [T, in]
    lora_a: torch.Tensor  # [L, S, R, in]
    out: torch.Tensor  # [T, N]
    lora_b: torch.Tensor  # [L, N, R]
    slice_sizes: tuple[int, ...]
    mapping: LoRAMapping


def make_case(
    slots: list[int],
    inputs: int,
    slice_sizes: tuple[int, ...],
    rank: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    tokens, parts, outputs = len(slots), len(slice_sizes), sum(slice_sizes)
    lora_a = torch.randn(SLOTS, parts, rank, inputs, generator=gen) * inputs**-0.5
    lora_b = torch.randn(SLOTS, outputs, rank, generator=gen) * rank**-0.5
    return Case(
        torch.randn(tokens, inputs, generator=gen).to(dtype),
        lora_a.to(dtype),
        torch.randn(tokens, outputs, generator=gen).to(dtype),
        lora_b.to(dtype),
        slice_sizes,
        mapping_of(slots),
    )


DECODE = [3, -1, 0, 0, 2, 1, -1, 3, 1, 2, 0]
PREFILL = [2] * 70 + [-1] * 9 + [0] * 20 + [2] * 66 + [1] * 3  # slot 2 in two segments
LONG_SEGMENT = [0] * 130 + [-1] * 3 + [1, 2, 1, 3, 0]  # slot 0: a long segment and a token
CASES = {
    "one-token": ([1], 67, (64, 16, 33), 8),
    "decode-s2-r16": (DECODE, 64, (40, 24), 16),
    "decode-s1-r1": (DECODE, 33, (37,), 1),
    "prefill-s3-r8": (PREFILL, 96, (64, 16, 33), 8),
    "prefill-s1-r16": (PREFILL, 48, (80,), 16),
    # parts wider than the compiled expand's column chunk, widths and a rank off its vectors
    "long-segment-s2-r8": (LONG_SEGMENT, 40, (24, 40), 8),
    "wide-s2-r40": (DECODE, 70, (200, 131), 40),
    "all-base": ([-1] * 5, 32, (16, 8), 8),
    "no-tokens": ([], 32, (16, 8, 8), 8),
}


def case_of(name: str, dtype: torch.dtype = torch.float32) -> Case:
    slots, inputs, sizes, rank = CASES[name]
    return make_case(slots, inputs, sizes, rank, dtype)


def naive_shrink(x: torch.Tensor, lora_a: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
    """Each token's own copy of its adapter's A, then one einsum."""
    slots = mapping.token_slots.long()
    weights = lora_a.float()[slots.clamp(min=0)]  # [T, S, R, in]
    buffer = torch.einsum("ti,tsri->str", x.float(), weights)
    return buffer * (slots >= 0).float()[None, :, None]


def naive_expand(
    out: torch.Tensor,
    buffer: torch.Tensor,
    lora_b: torch.Tensor,
    slice_sizes: tuple[int, ...],
    mapping: LoRAMapping,
) -> torch.Tensor:
    """A new ``out``: each token's parts of B gathered, one einsum per part, summed in float32."""
    slots = mapping.token_slots.long()
    weights = lora_b.float()[slots.clamp(min=0)]  # [T, N, R]
    deltas = torch.cat(
        [
            torch.einsum("tr,tnr->tn", buffer[part].float(), part_weights)
            for part, part_weights in enumerate(weights.split(list(slice_sizes), dim=1))
        ],
        dim=1,
    )
    deltas = deltas * (slots >= 0).float()[:, None]
    return (out.float() + deltas).to(out.dtype)


def expanded(op, case: Case, buffer: torch.Tensor) -> torch.Tensor:
    out = case.out.clone()
    assert op(out, buffer, case.lora_b, case.slice_sizes, case.mapping) is None
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
def test_the_reference_matches_a_per_token_computation(name, dtype):
    case = case_of(name, dtype)
    buffer = lora_shrink(case.x, case.lora_a, case.mapping)
    assert buffer.dtype == torch.float32
    assert buffer.shape == (len(case.slice_sizes), case.x.shape[0], case.lora_a.shape[2])
    torch.testing.assert_close(buffer, naive_shrink(case.x, case.lora_a, case.mapping))
    want = naive_expand(case.out, buffer, case.lora_b, case.slice_sizes, case.mapping)
    # Both sum in float32 and round once: equal up to float32 summation order.
    torch.testing.assert_close(expanded(lora_expand, case, buffer), want)


def test_tokens_of_the_base_model_get_zeros_and_keep_their_output():
    case = case_of("decode-s2-r16")
    base = case.mapping.token_slots < 0
    buffer = lora_shrink(case.x, case.lora_a, case.mapping)
    assert not buffer[:, base].any() and buffer[:, ~base].abs().sum() > 0
    # Even a buffer with values on their rows adds nothing to them.
    out = expanded(lora_expand, case, torch.randn(buffer.shape))
    assert torch.equal(out[base], case.out[base])
    assert not torch.equal(out[~base], case.out[~base])


def test_the_ops_are_overridable_and_default_to_the_reference():
    assert {"lora_shrink", "lora_expand"} <= set(OVERRIDABLE_OPS)
    assert LayerOps().lora_shrink is lora_shrink and LayerOps().lora_expand is lora_expand
    assert resolve_ops({"lora_expand": naive_expand}).lora_expand is naive_expand


def test_the_backend_api_exports_the_ops_and_their_types():
    from platform_core import backend_api

    for name in ("lora_shrink", "lora_expand", "LoRAShrinkFn", "LoRAExpandFn", "LoRAMapping"):
        assert name in backend_api.__all__ and getattr(backend_api, name) is not None
    assert backend_api.LoRASegment is LoRASegment


def _cpu_ops(level: str | None = None) -> tuple:
    """The CPU backend's ops: the torch path (``level`` None) or the compiled kernels of
    ``level``."""
    lora_ops = pytest.importorskip("platform_core_cpu.lora_ops", reason="pip install backends/cpu")
    compiled = None
    if level is not None:
        from platform_core_cpu import kernels

        build = kernels.load_kernels(level)
        assert build.ops is not None, f"the {level} kernels must build here: {build.reason}"
        compiled = build.ops
    ops = lora_ops.CpuLoRAOps(compiled)
    return ops.shrink, ops.expand


def _cpu_levels() -> list[str]:
    try:
        from platform_core_cpu.isa import host_isa
    except ImportError:
        return []
    return list(host_isa().supported)


REFERENCE = (lora_shrink, lora_expand)
CPU_LEVELS = _cpu_levels()
OPS = {
    "reference": lambda: REFERENCE,
    "cpu-torch": _cpu_ops,
    **{f"cpu-{level}": lambda level=level: _cpu_ops(level) for level in CPU_LEVELS},
}
CPU_PATHS = [name for name in OPS if name != "reference"]


@pytest.fixture(params=list(OPS))
def ops(request: pytest.FixtureRequest) -> tuple:
    return OPS[request.param]()


@pytest.mark.parametrize("path", CPU_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
def test_the_cpu_path_matches_the_reference(name, dtype, path):
    shrink, expand = OPS[path]()
    case = case_of(name, dtype)
    want = lora_shrink(case.x, case.lora_a, case.mapping)
    got = shrink(case.x, case.lora_a, case.mapping)
    assert_close(got, want, dtype)
    assert_close(expanded(expand, case, want), expanded(lora_expand, case, want), dtype)


@pytest.mark.parametrize("level", CPU_LEVELS)
def test_the_compiled_expand_sees_slots_written_since_its_last_call(level):
    """Its transposed copy of B is kept between calls, and made again after B is written."""
    _, expand = _cpu_ops(level)
    case = case_of("decode-s2-r16", torch.float32)
    buffer = lora_shrink(case.x, case.lora_a, case.mapping)
    first = expanded(expand, case, buffer)
    assert_close(first, expanded(lora_expand, case, buffer), torch.float32)
    case.lora_b[1].mul_(-3.0)  # another adapter loaded into slot 1, in place
    second = expanded(expand, case, buffer)
    assert not torch.equal(first, second)
    assert_close(second, expanded(lora_expand, case, buffer), torch.float32)
    with torch.inference_mode():  # no version counter: transposed on every call
        frozen = case.lora_b.clone()
    frozen_case = replace(case, lora_b=frozen)
    assert_close(expanded(expand, frozen_case, buffer), second, torch.float32)
    with torch.inference_mode():
        frozen.mul_(2.0)
    assert_close(
        expanded(expand, frozen_case, buffer),
        expanded(lora_expand, frozen_case, buffer),
        torch.float32,
    )


def test_the_cpu_path_groups_tokens_by_slot_once_per_step():
    lora_ops = pytest.importorskip("platform_core_cpu.lora_ops")
    ops = lora_ops.CpuLoRAOps()
    prefill = mapping_of(PREFILL)
    step = ops.groups(prefill, torch.device("cpu"))
    assert ops.groups(prefill, torch.device("cpu")) is step  # every layer of the step shares it
    by_slot = {group.slot: (group.rows, group.count) for group in step.groups}
    assert by_slot[0] == (slice(79, 99), 20) and by_slot[1] == (slice(165, 168), 3)
    rows, count = by_slot[2]
    assert count == 136 and rows.tolist() == [*range(70), *range(99, 165)]
    assert step.padded is None  # 136 tokens beside 20 and 3: padding would triple the rows
    # With the compiled kernels every token runs in them: no segment has MIN_GEMM_ROWS tokens.
    assert step.long == () and step.short_slots.tolist() == PREFILL
    decode = ops.groups(mapping_of(DECODE), torch.device("cpu"))
    assert decode is not step
    padded = decode.padded
    assert padded is not None
    assert padded.slots.tolist() == [3, 0, 2, 1] and padded.grid.shape == (4, 3)
    grid = padded.grid.view(-1)
    assert sorted(grid[padded.real].tolist()) == [i for i, s in enumerate(DECODE) if s >= 0]
    assert torch.equal(grid[padded.real], padded.tokens)
    assert decode.long == () and decode.short_slots.tolist() == DECODE
    # A segment of at least MIN_GEMM_ROWS tokens runs torch's GEMMs: the kernels see its
    # tokens as the base model's, and run the other token of its slot.
    assert lora_ops.MIN_GEMM_ROWS <= 130
    step = ops.groups(mapping_of(LONG_SEGMENT), torch.device("cpu"))
    assert [(group.slot, group.rows) for group in step.long] == [(0, slice(0, 130))]
    assert step.short_slots.tolist() == [-1] * 130 + LONG_SEGMENT[130:]
    assert ops.groups(mapping_of([0] * 200), torch.device("cpu")).short_slots is None


def test_the_cpu_backend_offers_the_ops():
    plugin = pytest.importorskip("platform_core_cpu.plugin")
    from platform_core_cpu.lora_ops import CpuLoRAOps

    backend = plugin.CpuBackend()
    overrides = backend.op_overrides()
    ops = overrides["lora_shrink"].__self__
    assert isinstance(ops, CpuLoRAOps)
    assert overrides["lora_expand"].__self__ is ops
    # The compiled kernels where the backend has them (the default here), else the torch path.
    assert ops._compiled is backend.attention.compiled_ops()
    assert ops._compiled is not None


def test_no_segments_and_no_tokens(ops):
    shrink, expand = ops
    for name in ("all-base", "no-tokens"):
        case = case_of(name)
        buffer = shrink(case.x, case.lora_a, case.mapping)
        assert buffer.shape == (len(case.slice_sizes), case.x.shape[0], 8)
        assert not buffer.any()
        assert torch.equal(expanded(expand, case, torch.randn(buffer.shape)), case.out)


@pytest.mark.parametrize("path", CPU_PATHS)
def test_activations_and_weights_of_different_dtypes(path):
    """bf16 activations and outputs with float32 adapter weights, and the other way round."""
    shrink, expand = OPS[path]()
    for activations, weights in ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)):
        case = case_of("wide-s2-r40", activations)
        lora_a, lora_b = case.lora_a.to(weights), case.lora_b.to(weights)
        want = lora_shrink(case.x, lora_a, case.mapping)
        assert_close(shrink(case.x, lora_a, case.mapping), want, torch.bfloat16)
        out, out_want = case.out.clone(), case.out.clone()
        expand(out, want, lora_b, case.slice_sizes, case.mapping)
        lora_expand(out_want, want, lora_b, case.slice_sizes, case.mapping)
        assert_close(out, out_want, activations)


def test_expand_on_a_strided_output(ops):
    """``out`` as a column slice of a wider tensor: the other columns are untouched."""
    shrink, expand = ops
    case = case_of("decode-s2-r16")
    buffer = shrink(case.x, case.lora_a, case.mapping)
    wide = torch.zeros(case.out.shape[0], case.out.shape[1] + 5)
    out = wide[:, 2 : 2 + case.out.shape[1]]
    out.copy_(case.out)
    expand(out, buffer, case.lora_b, case.slice_sizes, case.mapping)
    assert_close(out, expanded(lora_expand, case, buffer), torch.float32)
    assert not wide[:, :2].any() and not wide[:, -3:].any()


def test_shapes_that_do_not_fit_are_refused(ops):
    shrink, expand = ops
    case = case_of("decode-s2-r16")
    with pytest.raises(ValueError, match="input size 64 != x's 63"):
        shrink(case.x[:, :63], case.lora_a, case.mapping)
    with pytest.raises(ValueError, match="the mapping has 11 tokens, x has 10"):
        shrink(case.x[:10], case.lora_a, case.mapping)
    with pytest.raises(ValueError, match=r"x must be \[T, in\]"):
        shrink(case.x[0], case.lora_a, case.mapping)
    buffer = shrink(case.x, case.lora_a, case.mapping)
    with pytest.raises(ValueError, match=r"slice_sizes \(40, 23\)"):
        expand(case.out.clone(), buffer, case.lora_b, (40, 23), case.mapping)
    with pytest.raises(ValueError, match="one size per buffer part"):
        expand(case.out.clone(), buffer, case.lora_b, (64,), case.mapping)
    with pytest.raises(ValueError, match="buffer's rank 8"):
        expand(case.out.clone(), buffer[:, :, :8], case.lora_b, case.slice_sizes, case.mapping)


def _child_main() -> None:
    """Under the interpreter: whether the Triton ops match the reference, per case and dtype."""
    from platform_core.kernels.triton.ops import triton_op_overrides

    overrides = triton_op_overrides()
    shrink, expand = overrides["lora_shrink"], overrides["lora_expand"]
    results = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        for name in CASES:
            case = case_of(name, dtype)
            want = lora_shrink(case.x, case.lora_a, case.mapping)
            got = shrink(case.x, case.lora_a, case.mapping)
            out = expanded(expand, case, want).float()
            out_want = expanded(lora_expand, case, want).float()
            results[f"{name}-{dtype}"] = bool(
                got.dtype == torch.float32
                and torch.allclose(got, want, atol=tol, rtol=tol)
                and torch.allclose(out, out_want, atol=tol, rtol=tol)
            )
    print(json.dumps(results))


@pytest.fixture(scope="module")
def triton_results() -> dict[str, bool]:
    if not triton_installed():
        pytest.skip("triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return collect(start_child(__file__, "interpreted", env), "lora ops")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name", list(CASES))
def test_the_triton_kernels_match_the_reference(triton_results, name, dtype):
    assert triton_results[f"{name}-torch.{dtype}"]


if __name__ == "__main__" and sys.argv[1:] == ["interpreted"]:
    _child_main()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_segment_expands_in_the_outputs_dtype_within_its_rounding(dtype):
    """A segment of ``MIN_16BIT_GEMM_ROWS`` tokens expands with GEMMs straight into ``out``
    (bf16 ones for a bf16 output): relative RMS error at the dtype's rounding, not beyond."""
    lora_ops = pytest.importorskip("platform_core_cpu.lora_ops")
    rows = lora_ops.MIN_16BIT_GEMM_ROWS
    case = make_case([0] * rows + [-1] * 2 + [1] * 3, 128, (96, 32), 16, dtype)
    ops = lora_ops.CpuLoRAOps()
    want = lora_shrink(case.x, case.lora_a, case.mapping)
    out_want = expanded(lora_expand, case, want).float()
    out_got = expanded(ops.expand, case, want).float()
    bound = 1e-6 if dtype == torch.float32 else 5e-3
    assert (out_got - out_want).norm() / out_want.norm() < bound


def test_balanced_but_long_groups_run_one_by_one():
    lora_ops = pytest.importorskip("platform_core_cpu.lora_ops")
    rows = lora_ops.MAX_BATCHED_ROWS
    ops = lora_ops.CpuLoRAOps()
    short = ops.groups(mapping_of([0, 1] * rows), torch.device("cpu"))
    long = ops.groups(mapping_of([0] * (rows + 1) + [1] * (rows + 1)), torch.device("cpu"))
    assert short.padded is not None  # two interleaved groups of MAX_BATCHED_ROWS: batched
    assert long.padded is None  # equal, so balanced, but longer: each group its own GEMMs
    assert [group.rows for group in long.groups] == [
        slice(0, rows + 1),
        slice(rows + 1, 2 * rows + 2),
    ]
