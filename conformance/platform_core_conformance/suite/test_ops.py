"""Every op the backend overrides, against the core's default op, in every declared dtype.

The cases (``op_checks.OP_TABLE``) cover odd sizes, one row and many, bias present and absent,
strided views, tiny and large magnitudes; a failure names the op, the case and the worst element
with both values. The RMS bound is the dtype's, or twice the default op's own error in that dtype
if larger. Indices (``argmax``) and masked logits (``apply_token_bitmask``) must match exactly;
``lora_shrink``'s buffer is float32 in every dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import astuple

from platform_core_conformance.batches import TORCH_DTYPES
from platform_core_conformance.context import ConformanceContext
from platform_core_conformance.op_checks import OP_TABLE, OpCase, run_case
from platform_core_conformance.tolerances import Comparison, Tolerance, compare, tolerance_for


def test_op_override_matches_the_core_default(
    conformance: ConformanceContext,
    op_case: tuple[str, OpCase],
    dtype: str,
    record_error: Callable[[Comparison], None],
) -> None:
    op, case = op_case
    backend = conformance.backend
    run = run_case(op, case, conformance.op_overrides[op], TORCH_DTYPES[dtype], backend.device)
    backend.synchronize()
    label = f"op override {op!r} vs the core's default ({dtype}, case {case.name})"
    count = len(run.expected)
    assert len(run.actual) == count, f"{label}: {len(run.actual)} outputs, not {count}"
    for index, (ours, theirs, base) in enumerate(zip(run.actual, run.expected, run.baseline)):
        part = f"{label}, output {index}"
        shapes = f"shape {tuple(ours.shape)} != {tuple(theirs.shape)}"
        assert ours.shape == theirs.shape, f"{part}: {shapes}"
        if OP_TABLE[op].exact:
            wrong = (ours.cpu() != theirs).nonzero()[:8]  # the first few positions
            at = tuple(wrong.T)
            assert not len(wrong), (
                f"{part}: elements at {wrong.squeeze(-1).tolist()} differ: backend "
                f"{ours.cpu()[at].tolist()} vs default {theirs[at].tolist()}"
            )
            continue
        want = "float32" if OP_TABLE[op].float32_output else dtype
        assert ours.dtype == TORCH_DTYPES[want], f"{part}: returned {ours.dtype}, not {want}"
        tolerance = tolerance_for(dtype)
        floor = OP_TABLE[op].floor
        if floor is not None:
            tolerance = Tolerance(*(max(a, b) for a, b in zip(astuple(tolerance), astuple(floor))))
        own = compare(base, theirs, tolerance, scale=case.magnitude).rel_rms_error
        tolerance = dataclasses.replace(tolerance, rms=max(tolerance.rms, 2 * own))
        comparison = compare(ours, theirs, tolerance, scale=case.magnitude)
        record_error(comparison)
        comparison.check(label=part)
