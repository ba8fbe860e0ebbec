"""The cuda, rocm and xpu backends: probing, capabilities, config adjustments and errors, all
without a device (run-time logic and real-device checks are in ``test_gpu_runtime.py``).

Probing is tested twice: for real on this machine (no GPU: every GPU backend must report itself
unavailable with a reason and touch no device), and through the pure ``describe`` functions fed
with fabricated environments, which covers the outcomes a CPU box cannot produce.
"""

from __future__ import annotations

import logging
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch

from platform_core.config import EngineConfig
from platform_core.engine.setup import check_capabilities
from platform_core.errors import BackendError, UnsupportedByBackendError
from platform_core.plugins.manager import PluginManager

cuda_plugin = pytest.importorskip(
    "platform_core_cuda.plugin", reason="pip install -e backends/cuda"
)
cuda_probe = pytest.importorskip("platform_core_cuda.probe")
rocm_plugin = pytest.importorskip(
    "platform_core_rocm.plugin", reason="pip install -e backends/rocm"
)
rocm_probe = pytest.importorskip("platform_core_rocm.probe")
xpu_plugin = pytest.importorskip("platform_core_xpu.plugin", reason="pip install -e backends/xpu")
xpu_probe = pytest.importorskip("platform_core_xpu.probe")

HAS_CUDA = torch.cuda.is_available() and torch.version.cuda is not None
HAS_ACCELERATOR = torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


# --- probing on this machine -------------------------------------------------------------


@pytest.mark.skipif(HAS_ACCELERATOR, reason="checks the outcome on a machine without a GPU")
def test_gpu_backends_are_listed_unavailable_with_reasons_and_touch_no_device():
    rows = {r.name: r for r in PluginManager().probe()}
    for name, package in (
        ("cuda", "platform-core-cuda"),
        ("rocm", "platform-core-rocm"),
        ("xpu", "platform-core-xpu"),
    ):
        row = rows[name]
        assert row.package == package and row.version == "0.1.0"
        assert not row.available and row.reason
        assert row.capabilities is not None and 64 in row.capabilities.head_sizes
    if torch.version.cuda is None:
        assert "has no CUDA support" in rows["cuda"].reason
    assert not torch.cuda.is_initialized()
    assert PluginManager().choose("auto").name not in rows.keys() & {"cuda", "rocm", "xpu"}


@pytest.mark.skipif(HAS_ACCELERATOR, reason="checks the outcome on a machine without a GPU")
@pytest.mark.parametrize("name", ["cuda", "rocm", "xpu"])
def test_choosing_or_creating_an_unavailable_gpu_backend_names_the_reason(name):
    reason = {r.name: r for r in PluginManager().probe()}[name].reason
    with pytest.raises(BackendError, match=f"backend '{name}' is not available"):
        PluginManager().choose(name)
    plugin = {"cuda": cuda_plugin, "rocm": rocm_plugin, "xpu": xpu_plugin}[name]
    with pytest.raises(BackendError) as error:
        plugin.platform_core_create_backend(name=name, config=EngineConfig())
    assert reason in str(error.value)
    assert plugin.platform_core_create_backend(name="cpu", config=EngineConfig()) is None


# --- cuda: probing outcomes, capabilities, adjustments ------------------------------------


def _cuda_env(**overrides):
    base = dict(
        torch_version="2.13.0+cu130",
        cuda_version="13.0",
        hip_version=None,
        triton_version="3.7.1",
        device_count=2,
        count_source="nvml",
        gpus=(cuda_probe.GpuInfo("NVIDIA A100", (8, 0)),) * 2,
    )
    return cuda_probe.CudaEnvironment(**{**base, **overrides})


def test_cuda_available_row_describes_the_gpus():
    info = cuda_probe.describe(_cuda_env(), "0.1.0", cuda_graphs=True)
    assert info.available and info.priority == 100
    assert info.device == "cuda (2 x NVIDIA A100, sm_80)"
    assert "2 GPU(s) via nvml" in info.reason and "triton 3.7.1" in info.reason
    assert "bfloat16" in info.capabilities.dtypes
    assert info.capabilities.block_sizes == (16, 32, 64)
    assert "cuda_graphs" in info.capabilities.features
    no_graphs = cuda_probe.describe(_cuda_env(), "0.1.0", cuda_graphs=False)
    assert "cuda_graphs" not in no_graphs.capabilities.features


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"cuda_version": None, "hip_version": "7.0"}, "is a ROCm build; the rocm backend"),
        ({"cuda_version": None}, "has no CUDA support (a CPU build)"),
        ({"triton_version": None}, "triton is not installed (pip install triton==3.7.1)"),
        (
            {"device_count": 0, "gpus": (), "problem": "NVMLError_DriverNotLoaded()"},
            "no NVIDIA GPU visible (counted by nvml): NVMLError_DriverNotLoaded()",
        ),
    ],
)
def test_cuda_unavailable_reasons(overrides, expected):
    info = cuda_probe.describe(_cuda_env(**overrides), "0.1.0", cuda_graphs=True)
    assert not info.available
    assert expected in info.reason


def test_cuda_count_without_nvml_is_available_and_warns_if_it_touched_the_driver():
    env = _cuda_env(gpus=(), count_source="torch.cuda.device_count", problem="initialised CUDA")
    info = cuda_probe.describe(env, "0.1.0", cuda_graphs=True)
    assert info.available and info.device == "cuda (2 GPU(s))"
    assert "(warning: initialised CUDA)" in info.reason


def test_pre_ampere_gpus_do_not_declare_bf16_and_bf16_is_adjusted_to_fp16():
    env = _cuda_env(gpus=(cuda_probe.GpuInfo("Tesla T4", (7, 5)),), device_count=1)
    assert cuda_probe.describe(env, "0.1.0", True).capabilities.dtypes == ("float16", "float32")
    config = EngineConfig.from_flat(dtype="bfloat16")
    [change] = cuda_plugin.dtype_adjustments(config, (7, 5))
    assert (change.key, change.value) == ("dtype", "float16")
    assert "sm_75" in change.reason
    assert cuda_plugin.dtype_adjustments(config, (9, 0)) == []
    assert cuda_plugin.dtype_adjustments(EngineConfig.from_flat(dtype="float16"), (7, 5)) == []


def test_capability_errors_name_the_cuda_backend_and_valid_values():
    backend = SimpleNamespace(name="cuda", capabilities=cuda_probe.capabilities_for((), True))
    with pytest.raises(UnsupportedByBackendError, match=r"'cuda' does not support head_size=80"):
        check_capabilities(EngineConfig.from_flat(dtype="float16"), backend, head_size=80)
    with pytest.raises(UnsupportedByBackendError, match=r"block_size=8; valid values: \[16, 32"):
        check_capabilities(
            EngineConfig.from_flat(dtype="float16", block_size=8), backend, head_size=64
        )
    check_capabilities(EngineConfig.from_flat(dtype="bfloat16"), backend, head_size=128)


@pytest.mark.parametrize(
    ("env_value", "expected"),
    [
        (None, [0, 1, 2, 3]),
        ("", []),
        ("2,0", [2, 0]),
        ("1,7,2", [1]),  # the runtime stops at the first invalid entry
        ("GPU-8f3a,3", [None, 3]),
        ("-1", []),
    ],
)
def test_cuda_visible_devices_selection(env_value, expected):
    assert cuda_probe.visible_devices(4, env_value) == expected


class NvmlDriverNotLoaded(Exception):
    pass


def _fake_nvml(fail: bool = False) -> ModuleType:
    """A pynvml stand-in: two GPUs (an H100 and an A10), or a driver that is not loaded."""
    nvml = ModuleType("pynvml")
    gpus = [(b"NVIDIA H100", (9, 0)), ("NVIDIA A10", (8, 6))]
    calls = nvml.calls = []

    def init():
        calls.append("init")
        if fail:
            raise NvmlDriverNotLoaded("Driver Not Loaded")

    nvml.nvmlInit = init
    nvml.nvmlShutdown = lambda: calls.append("shutdown")
    nvml.nvmlDeviceGetCount = lambda: len(gpus)
    nvml.nvmlDeviceGetHandleByIndex = lambda index: index
    nvml.nvmlDeviceGetName = lambda handle: gpus[handle][0]
    nvml.nvmlDeviceGetCudaComputeCapability = lambda handle: gpus[handle][1]
    return nvml


def test_cuda_detect_counts_through_nvml_honouring_visible_devices(monkeypatch):
    nvml = _fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    env = cuda_probe.detect()
    assert (env.device_count, env.count_source) == (1, "nvml")
    assert env.gpus == (cuda_probe.GpuInfo("NVIDIA A10", (8, 6)),)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert cuda_probe.detect().gpus[0] == cuda_probe.GpuInfo("NVIDIA H100", (9, 0))
    assert nvml.calls == ["init", "shutdown"] * 2
    assert not torch.cuda.is_initialized()


def test_cuda_detect_reports_nvml_failures_and_falls_back_without_nvml(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    nvml = _fake_nvml(fail=True)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    env = cuda_probe.detect()
    assert env.device_count == 0 and "Driver Not Loaded" in env.problem
    assert nvml.calls == ["init"]  # nothing to shut down
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    env = cuda_probe.detect()
    assert env.count_source == "torch.cuda.device_count" and env.problem is None
    info = cuda_probe.describe(env, "0.1.0", cuda_graphs=True)
    if not HAS_CUDA:
        assert "no NVIDIA GPU visible (counted by torch.cuda.device_count)" in info.reason


def test_cuda_graphs_flag_and_launch_params(monkeypatch):
    monkeypatch.delenv(cuda_plugin.GRAPHS_ENV, raising=False)
    assert cuda_plugin.graphs_enabled()
    monkeypatch.setenv(cuda_plugin.GRAPHS_ENV, "0")
    assert not cuda_plugin.graphs_enabled()
    params = cuda_plugin.cuda_launch_params(num_sms=132)
    assert (params.target_programs, params.block_n, params.max_splits) == (264, 128, 64)
    assert params.launch_options() == {"num_warps": 4, "num_stages": 2}


# --- rocm and xpu ------------------------------------------------------------------------


def _rocm_env(**overrides):
    base = dict(
        torch_version="2.13.0+rocm7.0",
        hip_version="7.0",
        cuda_version=None,
        triton_version="3.7.1",
        device_count=8,
    )
    return rocm_probe.RocmEnvironment(**{**base, **overrides})


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"hip_version": None, "cuda_version": "13.0"}, "is a CUDA build; the cuda backend"),
        ({"hip_version": None}, "has no ROCm support (a CPU build)"),
        ({"triton_version": None}, "brings pytorch-triton-rocm"),
        ({"device_count": 0}, "no AMD GPU visible"),
    ],
)
def test_rocm_unavailable_reasons(overrides, expected):
    info = rocm_probe.describe(_rocm_env(**overrides), "0.1.0")
    assert not info.available and expected in info.reason


def test_rocm_available_row_and_launch_settings():
    info = rocm_probe.describe(_rocm_env(), "0.1.0")
    assert info.available and info.device == "rocm (8 GPU(s))" and "HIP 7.0" in info.reason
    params = rocm_plugin.rocm_launch_params(num_compute_units=304)
    assert params.launch_options() == {"num_warps": 4, "num_stages": 1, "waves_per_eu": 2}
    assert params.block_n == 64 and params.target_programs == 608


def _xpu_env(**overrides):
    base = dict(
        torch_version="2.13.0+xpu",
        xpu_compiled=True,
        triton_version="3.7.0",
        ipex_version=None,
        device_count=1,
    )
    return xpu_probe.XpuEnvironment(**{**base, **overrides})


@pytest.mark.parametrize(
    ("ipex", "triton", "kind", "reason"),
    [
        ("2.13.10+xpu", "3.7.0", "ipex", "2.13.10+xpu matches torch 2.13.0+xpu"),
        ("2.8.10+xpu", "3.7.0", "triton", "2.8.10+xpu does not match torch 2.13.0+xpu"),
        (None, "3.7.0", "triton", "intel-extension-for-pytorch is not installed; using the"),
        ("2.13.10+xpu", None, "ipex", "matches"),
        (None, None, None, "pytorch-triton-xpu) is missing"),
    ],
)
def test_xpu_attention_choice(ipex, triton, kind, reason):
    choice = xpu_probe.choose_attention(_xpu_env(ipex_version=ipex, triton_version=triton))
    assert choice.kind == kind and reason in choice.reason


def test_xpu_rows_and_the_logged_triton_choice(caplog):
    ok = xpu_probe.describe(_xpu_env(), "0.1.0")
    assert ok.available and ok.priority == 90 and "attention: triton" in ok.reason
    none = xpu_probe.describe(_xpu_env(triton_version=None), "0.1.0")
    assert not none.available and "no paged attention available" in none.reason
    cpu = xpu_probe.describe(_xpu_env(xpu_compiled=False, device_count=0), "0.1.0")
    assert "has no XPU support" in cpu.reason
    choice = xpu_probe.choose_attention(_xpu_env(ipex_version="2.8.0"))
    with caplog.at_level(logging.INFO, logger="platform_core_xpu"):
        ops = xpu_plugin.build_attention(choice, num_xe_cores=0)
    assert type(ops).__name__ == "TritonAttentionOps" and ops.params.target_programs == 0
    assert "XPU attention: Triton kernels (intel-extension-for-pytorch 2.8.0 does not" in (
        caplog.text
    )
    with pytest.raises(BackendError, match="no paged attention"):
        xpu_plugin.build_attention(xpu_probe.AttentionChoice(None, "nothing"), 0)


def test_backends_name_their_process_group_backend():
    assert cuda_plugin.CudaBackend.process_group_backend == "nccl"
    assert rocm_plugin.RocmBackend.process_group_backend == "nccl"  # RCCL behind the name
    assert xpu_plugin.XpuBackend.process_group_backend == "xccl"
