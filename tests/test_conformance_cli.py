"""``platform-core conformance``: the CLI runs the installed suite and writes both reports, and
the suite fails a backend whose attention is wrong (it is not a rubber stamp)."""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from platform_core_conformance import run_conformance
from platform_core_conformance.collectives import devices_short_of_world

from platform_core.attention.reference import ReferenceAttentionOps
from platform_core.config import EngineConfig
from platform_core.distributed.communicator import TorchDistributedCommunicator
from platform_core.entrypoints.conformance_cli import add_conformance_parser
from platform_core.plugins.hookspecs import hookimpl
from platform_core.plugins.interfaces import Backend, BackendInfo, Capabilities

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
    assert doc["summary"]["passed"] == doc["summary"]["total"] == len(checks) == 10
    kernel = checks["test_paged_attention[float32-mixed]"]
    assert kernel["outcome"] == "passed"
    assert 0 <= kernel["properties"]["max_abs_error"] <= kernel["properties"]["atol"]
    assert not any("bfloat16" in name or "collective" in name for name in checks)

    suite = ET.parse(junit).getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("10", "0", "0")
    assert _junit_properties(suite)["backend"] == "cpu"
    [case] = [c for c in suite.iter("testcase") if c.get("name") == kernel["id"].split("::")[-1]]
    assert float(_junit_properties(case)["max_abs_error"]) == kernel["properties"]["max_abs_error"]


class OffScaleAttention(ReferenceAttentionOps):
    """Softmax at a slightly wrong temperature: a subtle kernel bug."""

    def forward(self, query, kv_cache, metadata, scale):
        return super().forward(query, kv_cache, metadata, scale * 1.05)


class BrokenBackend(Backend):
    """The reference backend but for its attention."""

    def __init__(self) -> None:
        self.name = "broken-attention"
        self.device = torch.device("cpu")
        self.capabilities = BrokenPlugin.capabilities
        self.attention = OffScaleAttention()
        self.memory = None  # the kernel checks never profile

    def communicator(self, group: Any = None) -> TorchDistributedCommunicator:
        return TorchDistributedCommunicator(group=group)


class BrokenPlugin:
    """A backend plugin registered as an object (not an installed entry point)."""

    capabilities = Capabilities(dtypes=("float32",), head_sizes=(32,), block_sizes=(16,))

    @hookimpl
    def platform_core_backend_info(self) -> BackendInfo:
        return BackendInfo(
            "broken-attention", "tests", "0", (1, 0), True, "test", -99, "cpu", self.capabilities
        )

    @hookimpl
    def platform_core_create_backend(self, name: str, config: EngineConfig) -> Backend | None:
        return BrokenBackend() if name == "broken-attention" else None


def test_wrong_attention_fails_the_kernel_checks(tmp_path: Path) -> None:
    report = tmp_path / "broken.json"
    code = run_conformance(
        "broken-attention", report=report, keyword="test_kernels", backend_plugins=[BrokenPlugin()]
    )
    assert code == pytest.ExitCode.TESTS_FAILED
    checks = {c["id"].split("::")[-1]: c for c in json.loads(report.read_text())["checks"]}
    decode = checks["test_paged_attention[float32-decode]"]
    assert decode["outcome"] == "failed" and "exceeds the tolerance" in decode["message"]
    assert decode["properties"]["max_abs_error"] > decode["properties"]["atol"]
    # What the bug cannot change still passes: the write path, and softmax over a single key.
    assert checks["test_padding_slots_write_nothing[float32]"]["outcome"] == "passed"
    assert checks["test_paged_attention[float32-one_token]"]["outcome"] == "passed"


def test_unknown_backend_is_a_usage_error_that_names_it(capsys: pytest.CaptureFixture) -> None:
    assert _run_cli(["conformance", "--backend", "no-such-backend", "-k", "nothing"]) == USAGE_ERROR
    assert "no-such-backend" in capsys.readouterr().err


def test_collectives_need_one_device_per_rank(monkeypatch):
    cpu = SimpleNamespace(device=torch.device("cpu"))
    cuda = SimpleNamespace(device=torch.device("cuda", 0))
    assert devices_short_of_world(cpu) is None
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert devices_short_of_world(cuda) == "needs 2 cuda devices (one per rank), this machine has 1"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert devices_short_of_world(cuda) is None
