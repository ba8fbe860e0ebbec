"""Reports of a run that could not start: the backend is unknown, unavailable or incompatible.

Hardware CI reads the reports, not the console, so both are written before the run ends with
exit status 4 (pytest's usage error): the JSON report with the reason and the backend's probe
row when it has one, and a JUnit file whose single failed case carries the same reason.
"""

from __future__ import annotations

import dataclasses
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from platform_core.backend_api import BackendInfo, api_note
from platform_core_conformance.context import environment

EXIT_STATUS = int(pytest.ExitCode.USAGE_ERROR)
CASE_NAME = "backend_is_usable"


def unusable_document(name: str, reason: str, row: BackendInfo | None) -> dict[str, Any]:
    """The JSON report of a run refused before any check: who, why, and the probe row."""
    return {
        "backend": name,
        "exit_status": EXIT_STATUS,
        "reason": reason,
        "probe": dataclasses.asdict(row) if row is not None else None,
        "api_note": api_note(row.api_version) if row is not None else None,
        **environment(),
        "summary": {"total": 0, "passed": 0, "failed": 0, "skipped": 0, "error": 0},
        "checks": [],
    }


def _junit(name: str, reason: str) -> ET.ElementTree:
    suites = ET.Element("testsuites")
    suite = ET.SubElement(
        suites,
        "testsuite",
        name="platform-core-conformance",
        tests="1",
        failures="0",
        errors="1",
        skipped="0",
    )
    properties = ET.SubElement(suite, "properties")
    for key, value in {"backend": name, "exit_status": str(EXIT_STATUS), **environment()}.items():
        ET.SubElement(properties, "property", name=key, value=value)
    case = ET.SubElement(suite, "testcase", classname="conformance", name=CASE_NAME)
    ET.SubElement(case, "error", message=reason).text = reason
    return ET.ElementTree(suites)


def write_unusable_reports(
    name: str,
    reason: str,
    row: BackendInfo | None,
    report: str | Path | None,
    junit: str | Path | None,
) -> None:
    """Write the JSON and JUnit reports (those asked for) of a refused run."""
    if report is not None:
        path = Path(report)
        path.parent.mkdir(parents=True, exist_ok=True)
        document = unusable_document(name, reason, row)
        path.write_text(json.dumps(document, indent=2, default=str) + "\n")
    if junit is not None:
        path = Path(junit)
        path.parent.mkdir(parents=True, exist_ok=True)
        _junit(name, reason).write(path, encoding="utf-8", xml_declaration=True)
