"""Collectives of the backend's communicator across two spawned ranks, vs. exact values.

The ranks are spawned once per run; each (collective, dtype) pair is reported as its own check.
"""

from __future__ import annotations

import pytest

from platform_core_conformance.collectives import (
    CHECKS,
    CollectiveResults,
    devices_short_of_world,
    process_group_backend,
    run_collectives,
)
from platform_core_conformance.context import ConformanceContext


@pytest.fixture(scope="module")
def results(conformance: ConformanceContext) -> CollectiveResults:
    group_backend = process_group_backend(conformance.backend)
    if group_backend is None:
        pytest.skip(
            f"no process-group backend for device type {conformance.backend.device.type!r}: "
            "set the backend's process_group_backend attribute"
        )
    shortage = devices_short_of_world(conformance.backend)
    if shortage is not None:
        pytest.skip(shortage)
    return run_collectives(
        conformance.name,
        conformance.extra_plugins,
        group_backend,
        conformance.capabilities.dtypes,
    )


@pytest.mark.parametrize("op", list(CHECKS))
def test_collective(results: CollectiveResults, op: str, dtype: str) -> None:
    failure = results.failure(op, dtype)
    assert failure is None, failure
