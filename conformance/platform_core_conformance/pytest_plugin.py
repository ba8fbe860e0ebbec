"""The pytest plugin (entry point ``pytest11``): ``--backend`` and ``--conformance-report``.

Installed with the package, so it loads in every pytest run of the environment; it stays inert
(no torch import, no collection change) unless ``--backend`` is given. With ``--backend NAME``
and no test paths on the command line, the run collects the installed suite.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import pytest

from platform_core_conformance.runner import SUITE_DIR, ExtraBackendPlugins

if TYPE_CHECKING:
    from platform_core_conformance.context import ConformanceContext

CONTEXT_KEY = pytest.StashKey["ConformanceContext"]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("platform-core conformance")
    group.addoption(
        "--backend",
        default=None,
        metavar="NAME",
        help="run the platform-core conformance suite against the backend NAME",
    )
    group.addoption(
        "--kv-connector",
        default=None,
        metavar="NAME",
        help="the KV connector the connector section moves blocks with (default: loopback)",
    )
    group.addoption(
        "--kv-connector-config",
        default=None,
        metavar="JSON",
        help="extra kv_transfer_config keys for the connector section's connector",
    )
    group.addoption(
        "--conformance-report",
        default=None,
        metavar="PATH",
        help="write the conformance report (JSON) to PATH",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    name = config.getoption("backend")
    if name is None:
        return
    from platform_core_conformance.context import ConformanceContext
    from platform_core_conformance.report import JsonReport

    if config.args_source != pytest.Config.ArgsSource.ARGS:
        config.args = [str(SUITE_DIR)]
    extra = [
        plugin
        for holder in config.pluginmanager.get_plugins()
        if isinstance(holder, ExtraBackendPlugins)
        for plugin in holder.plugins
    ]
    report_path = config.getoption("conformance_report")
    try:
        context = ConformanceContext.create(name, extra)
    except Exception as exc:  # unknown, unavailable, incompatible, or its constructor raised
        _refuse(config, name, extra, exc)
    config.stash[CONTEXT_KEY] = context
    if report_path is not None:
        config.pluginmanager.register(JsonReport(context, Path(report_path)), "conformance-json")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Leave the suite alone in runs that did not ask for it (no ``--backend``)."""
    if config.getoption("backend") is None and collection_path.is_relative_to(SUITE_DIR):
        return True
    return None


def conformance_context(config: pytest.Config) -> ConformanceContext:
    """The context of the current run (set up by ``pytest_configure``)."""
    if CONTEXT_KEY not in config.stash:
        raise pytest.UsageError("the platform-core conformance suite needs --backend NAME")
    return config.stash[CONTEXT_KEY]


def _refuse(config: pytest.Config, name: str, extra: list[object], exc: Exception) -> NoReturn:
    """Write both reports of a run that cannot start, then end it (exit status 4)."""
    from platform_core.backend_api import BackendError
    from platform_core_conformance.context import backend_manager
    from platform_core_conformance.unusable import write_unusable_reports

    reason = str(exc) if isinstance(exc, BackendError) else f"creating the backend raised {exc!r}"
    rows = [row for row in backend_manager(extra).probe() if row.name == name]
    junit = getattr(config.option, "xmlpath", None)
    write_unusable_reports(
        name, reason, rows[0] if rows else None, config.getoption("conformance_report"), junit
    )
    raise pytest.UsageError(f"conformance: {reason}") from exc
