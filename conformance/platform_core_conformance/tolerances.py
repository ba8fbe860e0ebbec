"""Per-dtype tolerances of the kernel and op checks, and the comparison that measures the error.

The reference computes in float32 from inputs already rounded to the dtype under test, so the
measured error is the backend's own: its arithmetic plus rounding its output to the dtype. Two
bounds apply. Elementwise, ``|actual - expected| <= atol + rtol * |expected|`` (as
``torch.allclose``) catches a few badly wrong elements; over the whole output, the relative RMS
error ``||actual - expected|| / ||expected||`` catches a small error everywhere (a softmax scale
2% off stays inside a loose elementwise bound in bfloat16, but not inside this one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True, slots=True)
class Tolerance:
    """Allowed deviation from the reference for one dtype."""

    atol: float
    rtol: float
    rms: float  # allowed ||actual - expected|| / ||expected||

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


# Output rounding alone costs up to half an ulp: 2^-9 relative for bfloat16, 2^-12 for float16;
# the elementwise bounds also allow low-precision intermediates (e.g. probabilities stored in
# the dtype). The bf16 RMS bound sits above what the kernels measure (CPU backend ~2e-3, Triton
# ~3e-3 with probabilities in bf16) and below what a softmax scale 2% off costs (>= 8e-3).
TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(atol=1e-4, rtol=1e-4, rms=2e-5),
    "bfloat16": Tolerance(atol=2e-2, rtol=2e-2, rms=5e-3),
    "float16": Tolerance(atol=4e-3, rtol=4e-3, rms=1e-3),
}
# Generated-token logprobs of the end-to-end checks vs. HF transformers (float32 arithmetic on
# weights rounded to the dtype), per dtype; the CPU backend measures <= 0.035 in bfloat16.
LOGPROB_ATOL: dict[str, float] = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.03}


def tolerance_for(dtype: str) -> Tolerance:
    """The tolerance of ``dtype``; one the suite does not know gets the loosest listed."""
    return TOLERANCES.get(dtype, TOLERANCES["bfloat16"])


def logprob_atol_for(dtype: str) -> float:
    """The end-to-end logprob tolerance of ``dtype`` (the loosest for an unknown one)."""
    return LOGPROB_ATOL.get(dtype, max(LOGPROB_ATOL.values()))


Locator = Callable[[tuple[int, ...]], str]


def _index_text(index: tuple[int, ...]) -> str:
    return f"element {list(index)}"


@dataclass(frozen=True, slots=True)
class Comparison:
    """The outcome of comparing a backend's output to the reference, with its worst element."""

    max_abs_error: float
    rel_rms_error: float
    non_finite: int
    within_elementwise: bool
    tolerance: Tolerance
    worst_index: tuple[int, ...]
    worst_actual: float
    worst_expected: float

    @property
    def passed(self) -> bool:
        return self.non_finite == 0 and self.within_elementwise and self.within_rms

    @property
    def within_rms(self) -> bool:
        return self.rel_rms_error <= self.tolerance.rms

    def message(self, locate: Locator = _index_text, label: str = "backend vs reference") -> str:
        """What failed and where: the worst element with both values, located by ``locate``."""
        tol = self.tolerance
        if self.non_finite:
            what = f"{self.non_finite} non-finite (NaN/inf) output elements"
        elif not self.within_elementwise:
            what = (
                f"max |actual - expected| = {self.max_abs_error:.3g} exceeds the tolerance "
                f"atol={tol.atol:g} + rtol={tol.rtol:g} * |expected|"
            )
        else:
            what = (
                f"relative RMS error {self.rel_rms_error:.3g} exceeds {tol.rms:g} while every "
                "element is within its bound: a small error everywhere, e.g. a wrong scale"
            )
        return (
            f"{label}: {what}; worst at {locate(self.worst_index)}: backend "
            f"{self.worst_actual:.6g} vs reference {self.worst_expected:.6g} (relative RMS "
            f"error {self.rel_rms_error:.3g}, allowed {tol.rms:g})"
        )

    def check(self, locate: Locator = _index_text, label: str = "backend vs reference") -> None:
        """Raise ``AssertionError`` with :meth:`message` unless the comparison passed."""
        if not self.passed:
            raise AssertionError(self.message(locate, label))


def compare(
    actual: torch.Tensor, expected: torch.Tensor, tolerance: Tolerance, scale: float = 1.0
) -> Comparison:
    """Compare ``actual`` (any device and dtype) to the float32 ``expected``.

    ``scale`` is the typical magnitude of the inputs (``atol`` is in its units): an output that
    cancels to near zero from large terms keeps the absolute error of those terms.
    """
    actual = actual.detach().to("cpu", torch.float32)
    expected = expected.detach().to("cpu", torch.float32)
    if actual.shape != expected.shape:
        raise AssertionError(f"output shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    finite = torch.isfinite(actual)
    # NaN anywhere must fail and be the worst element: nan_to_num turns it into +inf.
    diff = torch.nan_to_num((actual - expected).abs(), nan=float("inf"))
    allowed = tolerance.atol * scale + tolerance.rtol * expected.abs()
    if not diff.numel():
        return Comparison(0.0, 0.0, 0, True, tolerance, (), 0.0, 0.0)
    # The worst element is the one furthest outside its own bound.
    flat = int(torch.argmax(diff / allowed))
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
    residual = torch.where(finite, actual - expected, torch.zeros(()))
    norm = float(torch.linalg.vector_norm(expected))
    rel_rms = float(torch.linalg.vector_norm(residual)) / norm if norm else 0.0
    return Comparison(
        max_abs_error=float(diff.max()),
        rel_rms_error=rel_rms,
        non_finite=int((~finite).sum()),
        within_elementwise=bool((diff <= allowed).all()),
        tolerance=tolerance,
        worst_index=index,
        worst_actual=float(actual[index]),
        worst_expected=float(expected[index]),
    )
