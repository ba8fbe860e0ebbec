"""The JSON conformance report: the run's header and one entry per check.

JUnit XML comes from pytest's own ``--junitxml``; the measured errors reach both reports
through ``record_property`` (``report.user_properties`` here).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from platform_core_conformance.context import ConformanceContext

OUTCOMES = ("passed", "failed", "skipped", "error")


def _message(report: pytest.TestReport | pytest.CollectReport) -> str | None:
    """A one-line reason: the skip reason or the failure's crash message."""
    longrepr = report.longrepr
    if longrepr is None:
        return None
    if isinstance(longrepr, tuple):  # a skip: (path, line, reason)
        return str(longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message
    return str(longrepr).strip().splitlines()[-1]


def _outcome(report: pytest.TestReport) -> str:
    """A phase's outcome; a failure outside the test body itself is an error."""
    if report.failed and report.when != "call":
        return "error"
    return report.outcome


class JsonReport:
    """A pytest plugin that collects every check's outcome and writes the JSON report."""

    def __init__(self, context: ConformanceContext, path: Path) -> None:
        self.context = context
        self.path = path
        self.checks: dict[str, dict[str, Any]] = {}
        self.started = time.time()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        entry = self.checks.setdefault(
            report.nodeid,
            {
                "id": report.nodeid,
                "outcome": "passed",
                "duration_s": 0.0,
                "message": None,
                "properties": {},
            },
        )
        entry["duration_s"] += report.duration
        entry["properties"].update(dict(report.user_properties))
        outcome = _outcome(report)
        # The first phase that does not pass decides (a setup skip, a call failure, ...).
        if outcome != "passed" and entry["outcome"] == "passed":
            entry["outcome"] = outcome
            entry["message"] = _message(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.checks[report.nodeid] = {
                "id": report.nodeid,
                "outcome": "error",
                "duration_s": 0.0,
                "message": _message(report),
                "properties": {},
            }

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        checks = list(self.checks.values())
        counts = Counter(check["outcome"] for check in checks)
        document = {
            **self.context.header(),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.started)),
            "duration_s": round(time.time() - self.started, 3),
            "exit_status": int(exitstatus),
            "summary": {"total": len(checks), **{name: counts[name] for name in OUTCOMES}},
            "checks": checks,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(document, indent=2, default=str) + "\n")
