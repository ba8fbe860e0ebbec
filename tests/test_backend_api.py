"""The backend API (``platform_core.backend_api``): every name resolves, importing it is cheap,
the backend packages and the conformance suite import nothing else of the core, and the shared
helpers behave (default communicator, versions, probe rows, the GPU backend skeleton)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import platform_core.backend_api as api

ROOT = Path(__file__).resolve().parents[1]
# Plugin packages and the conformance suite: they may import only the backend API and the
# top-level platform_core's LLM and SamplingParams.
RESTRICTED = ("backends", "conformance", "examples", "tests/plugins")
TOP_LEVEL_NAMES = {"LLM", "SamplingParams"}


def test_every_exported_name_resolves_and_is_listed_once():
    assert len(api.__all__) == len(set(api.__all__))
    assert set(api._LAZY) <= set(api.__all__)  # a lazy name nobody can see would be dead
    for name in api.__all__:
        assert getattr(api, name) is not None, name
    assert set(api.__all__) <= set(dir(api))
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        api.nothing_here  # noqa: B018


def test_lazy_names_are_the_objects_of_their_modules():
    from platform_core.distributed.communicator import TorchDistributedCommunicator
    from platform_core.layers.argmax import row_argmax

    assert api.TorchDistributedCommunicator is TorchDistributedCommunicator
    assert api.row_argmax is row_argmax


def test_importing_the_backend_api_imports_no_torch_triton_or_yaml():
    code = (
        "import sys, platform_core.backend_api; "
        "print(sorted(m for m in ('torch', 'triton', 'yaml') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def core_imports_outside_the_api(source: str) -> list[str]:
    """The ``platform_core`` imports of ``source`` that are neither the backend API, the KV
    connector API nor ``LLM``/``SamplingParams`` from the top-level package."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "platform_core":
                found += [a.name for a in node.names if a.name not in TOP_LEVEL_NAMES]
                continue
            modules = [node.module]
        else:
            continue
        found += [
            m
            for m in modules
            if (m == "platform_core" or m.startswith("platform_core."))
            and m not in ("platform_core.backend_api", "platform_core.kv_connector_api")
        ]
    return found


def test_the_layering_check_sees_deep_and_top_level_imports():
    source = (
        "import platform_core.config\nfrom platform_core.errors import BackendError\n"
        "from platform_core import LLM, bench\nfrom platform_core.backend_api import Backend\n"
        "from platform_core.kv_connector_api import PullWorker\n"
        "import platform_core.kv_transfer.pull_worker\nimport platform_core_cpu.plugin\n"
    )
    found = sorted(core_imports_outside_the_api(source))
    assert found == [
        "bench",
        "platform_core.config",
        "platform_core.errors",
        "platform_core.kv_transfer.pull_worker",
    ]


def test_backends_and_the_conformance_suite_import_only_the_backend_api():
    files = [p for folder in RESTRICTED for p in sorted((ROOT / folder).rglob("*.py"))]
    assert len(files) > 40
    offending = {
        str(p.relative_to(ROOT)): bad
        for p in files
        if (bad := core_imports_outside_the_api(p.read_text()))
    }
    assert offending == {}


class MinimalBackend(api.Backend):
    """Only what a backend must set: no communicator of its own."""

    def __init__(self) -> None:
        self.name = "minimal"
        self.device = torch.device("cpu")


def test_the_default_communicator_is_torch_distributed_on_the_backends_device():
    comm = MinimalBackend().communicator()
    assert isinstance(comm, api.TorchDistributedCommunicator)
    assert comm.device == torch.device("cpu") and (comm.rank, comm.world_size) == (0, 1)


def test_installed_version_takes_the_first_installed_distribution():
    assert api.installed_version("platform-core") == "0.1.0"
    assert api.installed_version("no-such-dist-xyz", "platform-core") == "0.1.0"
    assert api.installed_version("no-such-dist-xyz") == "unknown"
    assert api.installed_version("no-such-dist-xyz", missing="absent") == "absent"


def test_identity_rows_are_available_exactly_without_a_problem():
    identity = api.BackendIdentity("npu", "platform-core-npu", (1, 3), priority=7)
    caps = api.Capabilities(dtypes=("float32",), head_sizes=(64,), block_sizes=(16,))
    ok = identity.row("1.0", caps, "npu (1 GPU(s))", problem=None, ready="1 NPU", warning="hm")
    assert ok.available and ok.reason == "1 NPU (warning: hm)"
    assert (ok.name, ok.package, ok.priority) == ("npu", "platform-core-npu", 7)
    assert ok.api_version == (1, 3) and ok.capabilities is caps
    down = identity.row("1.0", caps, "npu (no GPU)", problem="no NPU", ready="1 NPU", warning="hm")
    assert not down.available and down.reason == "no NPU"
    with pytest.raises(api.BackendError, match="backend 'npu' is not available: no NPU"):
        api.require_available(down)
    api.require_available(ok)


def test_gpu_device_text_and_device_counting():
    assert api.gpu_device_text("rocm", 0) == "rocm (no GPU)"
    assert api.gpu_device_text("rocm", 8) == "rocm (8 GPU(s))"
    assert api.gpu_device_text("cuda", 2, "NVIDIA A100") == "cuda (2 x NVIDIA A100)"
    module = FakeDeviceModule(initialized=False)
    assert api.count_devices(module, "FAKE") == (2, None)
    module.initialized = True
    count, problem = api.count_devices(module, "FAKE")
    assert count == 2 and problem == "fake.device_count() initialised FAKE in the probing process"


class FakeDeviceModule:
    """Enough of torch.cuda / torch.xpu for the backend skeleton, on the CPU."""

    __name__ = "fake"

    def __init__(self, initialized: bool = False) -> None:
        self.initialized = initialized
        self.calls: list[tuple[str, object]] = []

    def device_count(self) -> int:
        return 2

    def is_initialized(self) -> bool:
        return self.initialized

    def set_device(self, device: torch.device) -> None:
        self.calls.append(("set_device", device))

    def get_device_properties(self, device: torch.device) -> SimpleNamespace:
        return SimpleNamespace(name="Fake GPU", multi_processor_count=4)

    def synchronize(self, device: torch.device) -> None:
        self.calls.append(("synchronize", device))


def test_accelerator_backend_takes_the_local_rank_device_and_its_module(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    module = FakeDeviceModule()
    backend = api.AcceleratorBackend("fake", "cpu", module)
    assert backend.device == torch.device("cpu", 1) and backend.name == "fake"
    assert backend.properties.multi_processor_count == 4
    assert isinstance(backend.memory, api.CachingAllocatorProfiler)
    assert backend.memory.module is module and backend.memory.device == backend.device
    backend.synchronize()
    assert module.calls == [("set_device", backend.device), ("synchronize", backend.device)]


def _fake_device_module(monkeypatch, module, **props):
    """Patch ``module`` (torch.cuda or torch.xpu) to a device with ``props``; returns its calls."""
    calls = []
    monkeypatch.setattr(module, "set_device", lambda device: calls.append(("set", device)))
    monkeypatch.setattr(module, "get_device_properties", lambda device: SimpleNamespace(**props))
    monkeypatch.setattr(module, "synchronize", lambda device: calls.append(("sync", device)))
    return calls


def test_the_gpu_backends_are_accelerator_backends_on_faked_devices(monkeypatch):
    cuda_plugin = pytest.importorskip("platform_core_cuda.plugin")
    rocm_plugin = pytest.importorskip("platform_core_rocm.plugin")
    xpu_plugin = pytest.importorskip("platform_core_xpu.plugin")
    from platform_core_rocm.probe import CAPABILITIES as ROCM_CAPABILITIES
    from platform_core_xpu.probe import AttentionChoice

    monkeypatch.setenv("LOCAL_RANK", "1")
    calls = _fake_device_module(
        monkeypatch, torch.cuda, name="NVIDIA T4", major=7, minor=5, multi_processor_count=40
    )
    cuda = cuda_plugin.CudaBackend()
    assert (cuda.name, cuda.compute_capability) == ("cuda", (7, 5))
    assert cuda.device == torch.device("cuda", 1)
    assert cuda.capabilities.dtypes == ("float16", "float32")  # no bf16 before Ampere
    assert cuda.attention.params.target_programs == 80 and cuda.memory.module is torch.cuda
    cuda.synchronize()
    assert calls == [("set", cuda.device), ("sync", cuda.device)]
    rocm = rocm_plugin.RocmBackend()
    assert rocm.capabilities == ROCM_CAPABILITIES and rocm.attention.params.block_n == 64
    _fake_device_module(monkeypatch, torch.xpu, name="Intel Arc", gpu_subslice_count=32)
    xpu = xpu_plugin.XpuBackend(AttentionChoice("triton", "test"))
    assert xpu.device == torch.device("xpu", 1) and xpu.memory.module is torch.xpu
    assert xpu.attention.params.target_programs == 64
    for backend in (cuda, rocm, xpu):
        assert backend.communicator().device == backend.device  # the default communicator
