"""``platform-core conformance``: the CLI runs the installed suite and writes both reports, also
when the backend cannot run (exit 4, with the reason and the fix); a plugin built for an older
minor API runs. ``test_conformance_broken`` checks that the suite fails broken backends."""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conformance_backends import FixturePlugin
from platform_core_conformance import run_conformance
from platform_core_conformance.collectives import devices_short_of_world

from platform_core.cli.conformance import add_conformance_parser
from platform_core.plugins.hookspecs import PLUGIN_API_VERSION

USAGE_ERROR = 4


def _run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="platform-core")
    add_conformance_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def _junit_properties(element: ET.Element) -> dict[str, str]:
    return {p.get("name"): p.get("value") for p in element.findall("properties/property")}


def test_cli_runs_a_subset_and_writes_json_and_junit_reports(tmp_path: Path) -> None:
    report, junit = tmp_path / "out" / "cpu.json", tmp_path / "cpu.xml"
    selection = "test_registration or (test_paged_attention and float32)"
    argv = ["conformance", "--backend", "cpu", "--report", str(report), "--junit", str(junit)]
    assert _run_cli([*argv, "-k", selection]) == 0

    doc = json.loads(report.read_text())
    assert (doc["backend"], doc["backend_package"]) == ("cpu", "platform-core-cpu")
    assert doc["platform_core_version"] == "0.1.0" and doc["exit_status"] == 0
    assert doc["device"].startswith("cpu") and doc["tolerances"]["float32"]["atol"] > 0
    checks = {c["id"].split("::")[-1]: c for c in doc["checks"]}
    assert doc["summary"]["passed"] == doc["summary"]["total"] == len(checks) == 11
    kernel = checks["test_paged_attention[float32-mixed]"]
    assert kernel["outcome"] == "passed"
    assert 0 <= kernel["properties"]["max_abs_error"] <= kernel["properties"]["atol"]
    assert not any("bfloat16" in name or "collective" in name for name in checks)

    suite = ET.parse(junit).getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("11", "0", "0")
    assert _junit_properties(suite)["backend"] == "cpu"
    [case] = [c for c in suite.iter("testcase") if c.get("name") == kernel["id"].split("::")[-1]]
    assert float(_junit_properties(case)["max_abs_error"]) == kernel["properties"]["max_abs_error"]


def test_unknown_backend_is_a_usage_error_that_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    report, junit = tmp_path / "r.json", tmp_path / "r.xml"
    argv = ["conformance", "--backend", "no-such-backend", "--report", str(report)]
    assert _run_cli([*argv, "--junit", str(junit), "-k", "nothing"]) == USAGE_ERROR
    assert "no-such-backend" in capsys.readouterr().err
    doc = json.loads(report.read_text())
    assert (doc["backend"], doc["exit_status"], doc["probe"]) == ("no-such-backend", 4, None)
    assert "unknown backend 'no-such-backend'" in doc["reason"]
    assert doc["summary"]["total"] == 0 and doc["plugin_api_version"]
    suite = ET.parse(junit).getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("errors")) == ("1", "1")
    [error] = suite.iter("error")
    assert "unknown backend 'no-such-backend'" in error.get("message")


@pytest.mark.parametrize(
    ("api", "advice"),
    [
        ((PLUGIN_API_VERSION[0], PLUGIN_API_VERSION[1] + 1), "upgrade platform-core"),
        ((PLUGIN_API_VERSION[0] + 1, 0), "rebuild the plugin for plugin API"),
    ],
    ids=["newer-minor", "newer-major"],
)
def test_an_incompatible_plugin_api_is_reported_with_the_fix(
    tmp_path: Path, api: tuple[int, int], advice: str
) -> None:
    report, junit = tmp_path / "r.json", tmp_path / "r.xml"
    plugin = FixturePlugin("future", api_version=api)
    code = run_conformance("future", report=report, junit=junit, backend_plugins=[plugin])
    assert code == USAGE_ERROR
    doc = json.loads(report.read_text())
    assert advice in doc["reason"] and doc["probe"]["api_version"] == list(api)
    assert doc["probe"]["available"] is False
    [error] = ET.parse(junit).getroot().iter("error")
    assert advice in error.get("message")


def test_a_plugin_pinned_to_api_1_0_runs_on_this_core_with_a_note(tmp_path: Path) -> None:
    report = tmp_path / "old.json"
    plugin = FixturePlugin("api-1-0", api_version=(1, 0))
    code = run_conformance(
        "api-1-0", report=report, keyword="test_registration", backend_plugins=[plugin]
    )
    assert code == 0
    doc = json.loads(report.read_text())
    assert doc["backend_api_version"] == "1.0" and doc["summary"]["passed"] >= 4
    if PLUGIN_API_VERSION > (1, 0):
        assert "older than this platform-core's" in doc["api_note"]


def test_a_backend_whose_constructor_raises_still_gets_its_reports(tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    plugin = FixturePlugin("raises", attention=lambda: 1 / 0)
    code = run_conformance("raises", report=report, backend_plugins=[plugin])
    assert code == USAGE_ERROR
    reason = json.loads(report.read_text())["reason"]
    assert "failed to create backend 'raises': ZeroDivisionError" in reason


def test_collectives_need_one_device_per_rank(monkeypatch):
    cpu = SimpleNamespace(device=torch.device("cpu"))
    cuda = SimpleNamespace(device=torch.device("cuda", 0))
    assert devices_short_of_world(cpu) is None
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert devices_short_of_world(cuda) == "needs 2 cuda devices (one per rank), this machine has 1"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert devices_short_of_world(cuda) is None
