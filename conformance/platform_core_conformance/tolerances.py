"""Per-dtype tolerances of the kernel checks, and the comparison that measures the error.

The reference computes in float32 from inputs already rounded to the dtype under test, so the
measured error is the backend's own: its arithmetic plus rounding its output to the dtype. An
element passes when ``|actual - expected| <= atol + rtol * |expected|`` (as ``torch.allclose``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True, slots=True)
class Tolerance:
    """Allowed deviation from the reference for one dtype."""

    atol: float
    rtol: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


# Output rounding alone costs up to half an ulp: 2^-9 relative for bfloat16, 2^-12 for float16;
# the rest allows low-precision intermediates (e.g. probabilities stored in the dtype).
TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(atol=1e-4, rtol=1e-4),
    "bfloat16": Tolerance(atol=2e-2, rtol=2e-2),
    "float16": Tolerance(atol=4e-3, rtol=4e-3),
}
# Generated-token logprobs of the end-to-end checks (float32 only) vs. HF transformers.
LOGPROB_ATOL = 1e-3


def tolerance_for(dtype: str) -> Tolerance:
    """The tolerance of ``dtype``; one the suite does not know gets the loosest listed."""
    return TOLERANCES.get(dtype, TOLERANCES["bfloat16"])


@dataclass(frozen=True, slots=True)
class Comparison:
    """The outcome of comparing a backend's output to the reference."""

    max_abs_error: float
    tolerance: Tolerance
    passed: bool

    def message(self) -> str:
        return (
            f"max |actual - expected| = {self.max_abs_error:.3g} exceeds the tolerance "
            f"atol={self.tolerance.atol:g} + rtol={self.tolerance.rtol:g} * |expected|"
        )


def compare(actual: torch.Tensor, expected: torch.Tensor, tolerance: Tolerance) -> Comparison:
    """Compare ``actual`` (any device and dtype) to the float32 ``expected``."""
    actual = actual.detach().to("cpu", torch.float32)
    expected = expected.detach().to("cpu", torch.float32)
    if actual.shape != expected.shape:
        raise AssertionError(f"output shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    diff = (actual - expected).abs()
    # NaN anywhere must fail: nan_to_num turns it into +inf before the max.
    diff = torch.nan_to_num(diff, nan=float("inf"))
    allowed = tolerance.atol + tolerance.rtol * expected.abs()
    max_error = float(diff.max()) if diff.numel() else 0.0
    return Comparison(max_error, tolerance, bool((diff <= allowed).all()))
