"""Fixtures of the suite: the backend under test, its capability axes, report properties.

Tests ask for ``dtype``, ``head_size`` or ``block_size`` to run once per declared value; for
``undeclared_*`` to run on values outside the declaration (the negative checks).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from platform_core.plugins.interfaces import Backend, Capabilities
from platform_core_conformance.batches import TORCH_DTYPES
from platform_core_conformance.context import ConformanceContext
from platform_core_conformance.engine import E2E_MAX_TOKENS
from platform_core_conformance.pytest_plugin import conformance_context
from platform_core_conformance.tiny_models import TinyModel, hf_greedy, save_tiny_model
from platform_core_conformance.tolerances import Comparison

CORE_DTYPES = tuple(TORCH_DTYPES)  # every dtype an engine config can name


def preferred(values: tuple[int, ...], wanted: int) -> int:
    """``wanted`` if declared, else the smallest declared value."""
    return wanted if wanted in values else min(values)


def _axes(caps: Capabilities) -> dict[str, list]:
    undeclared = [d for d in CORE_DTYPES if d not in caps.dtypes]
    skip_all = pytest.mark.skip(
        reason=f"the backend declares every dtype the core has {CORE_DTYPES}"
    )
    return {
        "dtype": [pytest.param(d, id=d) for d in caps.dtypes],
        "head_size": [pytest.param(h, id=f"h{h}") for h in caps.head_sizes],
        "block_size": [pytest.param(b, id=f"b{b}") for b in caps.block_sizes],
        "undeclared_dtype": [pytest.param(d, id=d) for d in undeclared]
        or [pytest.param(None, id="none", marks=skip_all)],
    }


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    caps = conformance_context(metafunc.config).capabilities
    for name, values in _axes(caps).items():
        if name in metafunc.fixturenames:
            metafunc.parametrize(name, values)


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
        record_property("atol", comparison.tolerance.atol)
        record_property("rtol", comparison.tolerance.rtol)

    return record


@pytest.fixture(scope="session")
def base_head_size(capabilities: Capabilities) -> int:
    return preferred(capabilities.head_sizes, 64)


@pytest.fixture(scope="session")
def base_block_size(capabilities: Capabilities) -> int:
    return preferred(capabilities.block_sizes, 16)


@pytest.fixture(scope="session")
def engine_dtype(capabilities: Capabilities) -> str:
    """float32 (the only dtype whose greedy tokens must equal HF's); else the check skips."""
    if "float32" not in capabilities.dtypes:
        pytest.skip(f"the backend does not declare float32 (declares {capabilities.dtypes})")
    return "float32"


@pytest.fixture(scope="session")
def model_head_size(capabilities: Capabilities) -> int:
    """The tiny models' head size: the smallest declared one of at least 16."""
    sizes = capabilities.head_sizes
    return min((h for h in sizes if h >= 16), default=max(sizes))


@pytest.fixture(scope="session")
def tiny_model(
    tmp_path_factory: pytest.TempPathFactory, model_head_size: int
) -> Callable[..., TinyModel]:
    """Factory: ``tiny_model("llama")`` -> a saved tiny model (built once per session)."""
    built: dict[tuple[str, int], TinyModel] = {}

    def get(arch: str, head_size: int | None = None) -> TinyModel:
        key = (arch, head_size or model_head_size)
        if key not in built:
            path: Path = tmp_path_factory.mktemp(f"tiny-{arch}-h{key[1]}")
            built[key] = save_tiny_model(arch, key[1], path)
        return built[key]

    return get


@pytest.fixture(scope="session")
def hf_reference() -> Callable[[TinyModel, list[int]], tuple[list[int], list[float]]]:
    """Factory: HF transformers' greedy tokens and logprobs for a prompt (memoized)."""
    cache: dict[tuple[str, int, tuple[int, ...]], tuple[list[int], list[float]]] = {}

    def get(model: TinyModel, prompt: list[int]) -> tuple[list[int], list[float]]:
        key = (model.arch, model.head_size, tuple(prompt))
        if key not in cache:
            cache[key] = hf_greedy(model.hf_model, prompt, E2E_MAX_TOKENS)
        return cache[key]

    return get
