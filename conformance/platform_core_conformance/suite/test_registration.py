"""The backend is installed, probes available, and describes itself consistently."""

from __future__ import annotations

import torch

from platform_core.backend_api import BackendError, api_compatible, resolve_ops
from platform_core_conformance.batches import TORCH_DTYPES
from platform_core_conformance.context import ConformanceContext


def test_probe_row_is_available_and_api_compatible(conformance: ConformanceContext) -> None:
    info = conformance.info
    assert info.available, info.reason
    assert api_compatible(info.api_version), info.api_version
    assert info.package and info.version and info.device, info


def test_backend_object_matches_its_probe(conformance: ConformanceContext) -> None:
    backend, info = conformance.backend, conformance.info
    assert backend.name == info.name
    assert isinstance(backend.device, torch.device)
    if info.capabilities is not None:
        assert info.capabilities == backend.capabilities, "probe and backend disagree"


def test_capabilities_are_well_formed(conformance: ConformanceContext) -> None:
    caps = conformance.capabilities
    assert caps.dtypes and set(caps.dtypes) <= set(TORCH_DTYPES), caps.dtypes
    for name in ("head_sizes", "block_sizes"):
        values = getattr(caps, name)
        assert values and all(isinstance(v, int) and v > 0 for v in values), (name, values)
    assert caps.max_batch is None or caps.max_batch >= 1
    assert all(isinstance(f, str) and f for f in caps.features), caps.features


def test_op_overrides_are_known_callables(conformance: ConformanceContext) -> None:
    """A misspelt name would silently run the core's default; the engine refuses it too."""
    overrides = conformance.op_overrides
    for op, fn in overrides.items():
        assert callable(fn), f"op override {op!r} is {fn!r}, not a callable"
    try:
        resolve_ops(overrides)
    except BackendError as exc:
        raise AssertionError(str(exc)) from None
