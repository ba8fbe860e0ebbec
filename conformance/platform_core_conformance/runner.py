"""Runs the installed suite through ``pytest.main`` (what ``platform-core conformance`` calls)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parent
SUITE_DIR = PACKAGE_DIR / "suite"
INI_FILE = PACKAGE_DIR / "pytest.ini"
PLUGIN_MODULE = "platform_core_conformance.pytest_plugin"


class ExtraBackendPlugins:
    """Backend plugin objects to register beside the installed entry points (see ``context``).

    Handed to ``pytest.main`` as a pytest plugin so that the run's configuration finds them.
    """

    def __init__(self, plugins: Sequence[object]) -> None:
        self.plugins = tuple(plugins)


def conformance_args(
    backend: str,
    report: str | Path | None = None,
    junit: str | Path | None = None,
    keyword: str | None = None,
    pytest_args: Sequence[str] = (),
) -> list[str]:
    """The pytest command line of a conformance run of ``backend``."""
    args = [str(SUITE_DIR), "-c", str(INI_FILE), "--rootdir", str(PACKAGE_DIR)]
    args += ["--backend", backend]
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        args += ["-p", PLUGIN_MODULE]  # otherwise the pytest11 entry point has loaded it
    if report is not None:
        args += ["--conformance-report", str(report)]
    if junit is not None:
        args += ["--junitxml", str(junit)]
    if keyword:
        args += ["-k", keyword]
    return args + list(pytest_args)


def run_conformance(
    backend: str,
    *,
    report: str | Path | None = None,
    junit: str | Path | None = None,
    keyword: str | None = None,
    pytest_args: Sequence[str] = (),
    backend_plugins: Sequence[object] = (),
) -> int:
    """Run the suite against ``backend``; returns pytest's exit code (0: every check passed).

    Args:
        backend: the backend's registered name.
        report: where to write the JSON report.
        junit: where to write the JUnit XML report.
        keyword: a pytest ``-k`` expression selecting checks.
        pytest_args: further pytest arguments (``-x``, ``-v``, ...).
        backend_plugins: backend plugin objects to register besides the installed entry points
            (for backends not installed as packages; the engine itself cannot load those, so
            the end-to-end checks need an installed backend).
    """
    args = conformance_args(backend, report, junit, keyword, pytest_args)
    plugins = [ExtraBackendPlugins(backend_plugins)] if backend_plugins else []
    return int(pytest.main(args, plugins=plugins))
