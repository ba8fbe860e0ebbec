"""Requests outside the declared capabilities fail at start-up with a clear error.

The error must be ``UnsupportedByBackendError`` naming the backend and the capability: never a
crash deeper down or wrong numbers. A backend may instead adjust the request (``adjust_config``)
to a value it declares; the engine then runs with that value.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest

from platform_core.backend_api import UnsupportedByBackendError
from platform_core_conformance.context import ConformanceContext
from platform_core_conformance.engine import generate_greedy, make_llm
from platform_core_conformance.tiny_models import TinyModel


def first_undeclared(values: tuple[int, ...]) -> int:
    """The smallest multiple of 8 not in ``values``."""
    return next(v for v in itertools.count(8, 8) if v not in values)


def _refused_or_adjusted(
    conformance: ConformanceContext,
    model: TinyModel,
    capability: str,
    value: Any,
    declared: tuple[Any, ...],
    record_property: Callable[[str, object], None],
    **request: Any,
) -> None:
    try:
        llm = make_llm(conformance, model.path, **request)
    except UnsupportedByBackendError as exc:
        record_property("handling", "refused")
        assert (exc.backend, exc.capability, exc.value) == (conformance.name, capability, value)
        assert conformance.name in str(exc) and capability in str(exc), str(exc)
        return
    used = llm.engine.config.to_flat()[capability]
    record_property("handling", f"adjusted to {used}")
    assert used in declared, f"the engine started with undeclared {capability}={used!r}"
    [generation] = generate_greedy(llm, [[5, 6, 7]], max_tokens=2)
    assert len(generation.tokens) == 2


def test_undeclared_dtype_is_refused(
    conformance: ConformanceContext,
    tiny_model: Callable[..., TinyModel],
    undeclared_dtype: str,
    record_property: Callable[[str, object], None],
) -> None:
    _refused_or_adjusted(
        conformance,
        tiny_model("llama"),
        "dtype",
        undeclared_dtype,
        conformance.capabilities.dtypes,
        record_property,
        dtype=undeclared_dtype,
    )


def test_undeclared_block_size_is_refused(
    conformance: ConformanceContext,
    tiny_model: Callable[..., TinyModel],
    record_property: Callable[[str, object], None],
) -> None:
    declared = conformance.capabilities.block_sizes
    block_size = first_undeclared(declared)
    _refused_or_adjusted(
        conformance,
        tiny_model("llama"),
        "block_size",
        block_size,
        declared,
        record_property,
        block_size=block_size,
    )


def test_undeclared_head_size_is_refused(
    conformance: ConformanceContext, tiny_model: Callable[..., TinyModel]
) -> None:
    head_size = first_undeclared(conformance.capabilities.head_sizes)
    with pytest.raises(UnsupportedByBackendError) as caught:
        make_llm(conformance, tiny_model("llama", head_size).path)
    exc = caught.value
    assert (exc.backend, exc.capability, exc.value) == (conformance.name, "head_size", head_size)
    assert conformance.name in str(exc) and "head_size" in str(exc), str(exc)
