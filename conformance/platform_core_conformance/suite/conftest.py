"""Fixtures of the suite: the backend under test, its capability axes, report properties.

Tests ask for ``dtype``, ``head_size`` or ``block_size`` to run once per declared value; for
``matrix_point`` to run on (head size, block size) pairs that together cover every declared head
size and block size; for ``op_case`` to run on every case of every op the backend overrides; for
``undeclared_*`` to run on values outside the declaration (the negative checks).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from platform_core.backend_api import Backend, Capabilities
from platform_core_conformance.batches import TORCH_DTYPES
from platform_core_conformance.context import ConformanceContext
from platform_core_conformance.generation import Reference
from platform_core_conformance.op_checks import OP_TABLE
from platform_core_conformance.prerequisites import (
    order_prerequisites_first,
    record_failure,
    skip_if_prerequisite_failed,
)
from platform_core_conformance.pytest_plugin import conformance_context
from platform_core_conformance.tiny_models import TinyModel, hf_logprob_rows, save_tiny_model
from platform_core_conformance.tolerances import Comparison

CORE_DTYPES = tuple(TORCH_DTYPES)  # every dtype an engine config can name


def preferred(values: tuple[int, ...], wanted: int) -> int:
    """``wanted`` if declared, else the smallest declared value."""
    return wanted if wanted in values else min(values)


def _op_cases(overrides: dict[str, object]) -> list:
    """One param per (overridden op, case); unknown names are the registration check's."""
    params = [
        pytest.param((op, case), id=f"{op}-{case.name}")
        for op in sorted(set(overrides) & set(OP_TABLE))
        for case in OP_TABLE[op].cases
    ]
    skip = pytest.mark.skip(reason="the backend overrides no op: the core's defaults run")
    return params or [pytest.param(None, id="none", marks=skip)]


def covering_pairs(head_sizes: tuple[int, ...], block_sizes: tuple[int, ...]) -> list:
    """``max(len)`` pairs in which every head size and every block size appears."""
    count = max(len(head_sizes), len(block_sizes))
    return [
        (head_sizes[i % len(head_sizes)], block_sizes[i % len(block_sizes)]) for i in range(count)
    ]


def _axes(context: ConformanceContext) -> dict[str, list]:
    caps = context.capabilities
    undeclared = [d for d in CORE_DTYPES if d not in caps.dtypes]
    skip_all = pytest.mark.skip(
        reason=f"the backend declares every dtype the core has {CORE_DTYPES}"
    )
    return {
        "dtype": [pytest.param(d, id=d) for d in caps.dtypes],
        "head_size": [pytest.param(h, id=f"h{h}") for h in caps.head_sizes],
        "block_size": [pytest.param(b, id=f"b{b}") for b in caps.block_sizes],
        "matrix_point": [
            pytest.param(pair, id=f"h{pair[0]}-b{pair[1]}")
            for pair in covering_pairs(caps.head_sizes, caps.block_sizes)
        ],
        "undeclared_dtype": [pytest.param(d, id=d) for d in undeclared]
        or [pytest.param(None, id="none", marks=skip_all)],
    }


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    context = conformance_context(metafunc.config)
    for name, values in _axes(context).items():
        if name in metafunc.fixturenames:
            metafunc.parametrize(name, values)
    if "op_case" in metafunc.fixturenames:  # asks the backend: only where a check needs it
        metafunc.parametrize("op_case", _op_cases(context.op_overrides))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    order_prerequisites_first(items)


def pytest_runtest_setup(item: pytest.Item) -> None:
    skip_if_prerequisite_failed(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    report = yield
    record_failure(item, report)
    return report


@pytest.fixture(scope="session")
def conformance(pytestconfig: pytest.Config) -> ConformanceContext:
    """The run's context: probe row and backend object."""
    return conformance_context(pytestconfig)


@pytest.fixture(scope="session")
def backend(conformance: ConformanceContext) -> Backend:
    return conformance.backend


@pytest.fixture(scope="session")
def capabilities(conformance: ConformanceContext) -> Capabilities:
    return conformance.capabilities


@pytest.fixture(scope="session", autouse=True)
def _report_header(
    conformance: ConformanceContext, record_testsuite_property: Callable[[str, object], None]
) -> None:
    """Who was tested on what, as JUnit testsuite properties."""
    for key, value in conformance.header().items():
        if isinstance(value, str):
            record_testsuite_property(key, value)


@pytest.fixture
def record_error(record_property: Callable[[str, object], None]) -> Callable[[Comparison], None]:
    """Records a comparison's measured error and tolerance in both reports."""

    def record(comparison: Comparison) -> None:
        record_property("max_abs_error", comparison.max_abs_error)
        record_property("rel_rms_error", comparison.rel_rms_error)
        for name, value in comparison.tolerance.as_dict().items():
            record_property(name, value)

    return record


@pytest.fixture(scope="session")
def base_head_size(capabilities: Capabilities) -> int:
    return preferred(capabilities.head_sizes, 64)


@pytest.fixture(scope="session")
def base_block_size(capabilities: Capabilities) -> int:
    return preferred(capabilities.block_sizes, 16)


@pytest.fixture(scope="session")
def model_head_size(capabilities: Capabilities) -> int:
    """The tiny models' head size: the smallest declared one of at least 16."""
    sizes = capabilities.head_sizes
    return min((h for h in sizes if h >= 16), default=max(sizes))


@pytest.fixture(scope="session")
def tiny_model(
    tmp_path_factory: pytest.TempPathFactory, model_head_size: int
) -> Callable[..., TinyModel]:
    """Factory: ``tiny_model("llama", head_size=None, magnitude=1.0)`` -> a saved tiny model
    (built once per session; the head size defaults to ``model_head_size``)."""
    built: dict[tuple[str, int, float], TinyModel] = {}

    def get(arch: str, head_size: int | None = None, magnitude: float = 1.0) -> TinyModel:
        key = (arch, head_size or model_head_size, magnitude)
        if key not in built:
            path: Path = tmp_path_factory.mktemp(f"tiny-{arch}-h{key[1]}")
            built[key] = save_tiny_model(arch, key[1], path, magnitude)
        return built[key]

    return get


@pytest.fixture(scope="session")
def hf_reference() -> Callable[[TinyModel, str], Reference]:
    """Factory: the teacher-forced HF log-probabilities of a model whose weights are rounded to
    ``dtype`` (memoized per sequence)."""
    cache: dict[tuple[str, str, tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}

    def of(model: TinyModel, dtype: str) -> Reference:
        hf_model = model.reference(TORCH_DTYPES[dtype])

        def rows(prompt: list[int], tokens: list[int]) -> torch.Tensor:
            key = (model.label, dtype, tuple(prompt), tuple(tokens))
            if key not in cache:
                cache[key] = hf_logprob_rows(hf_model, prompt, tokens)
            return cache[key]

        return rows

    return of
