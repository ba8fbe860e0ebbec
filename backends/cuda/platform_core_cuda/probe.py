"""Finding NVIDIA GPUs without creating a CUDA context in the probing process.

Counts come from NVML (the optional ``nvidia-ml-py`` package) when it is installed, else from
``torch.cuda.device_count()``, which torch answers through NVML too where it can; it never
creates a context, and :func:`detect` checks ``torch.cuda.is_initialized()`` afterwards to prove
it. :func:`describe` turns what was found into the ``BackendInfo`` row, and is a pure function
so every outcome is tested without a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

import torch

from platform_core.kernels.triton import KERNEL_BLOCK_SIZES, KERNEL_HEAD_SIZES, triton_installed
from platform_core.plugins.interfaces import BackendInfo, Capabilities

NAME = "cuda"
PACKAGE = "platform-core-cuda"
API_VERSION = (1, 0)
PRIORITY = 100
BF16_MIN_CAPABILITY = (8, 0)  # Ampere


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """One visible GPU as NVML describes it (``None``: not known)."""

    name: str
    compute_capability: tuple[int, int] | None


@dataclass(frozen=True, slots=True)
class CudaEnvironment:
    """What probing found: torch's build, triton, and the visible GPUs.

    ``gpus`` holds details only when NVML could give them; ``problem`` says what went wrong
    while counting (or that counting touched the CUDA driver).
    """

    torch_version: str
    cuda_version: str | None
    hip_version: str | None
    triton_version: str | None
    device_count: int
    count_source: str
    gpus: tuple[GpuInfo, ...] = ()
    problem: str | None = None


def package_version(distribution: str) -> str:
    """Installed version of ``distribution`` or ``"unknown"``."""
    try:
        return version(distribution)
    except PackageNotFoundError:
        return "unknown"


def visible_devices(physical_count: int, env_value: str | None) -> list[int | None]:
    """Physical indices selected by ``CUDA_VISIBLE_DEVICES`` (``None``: selected by UUID).

    Unset means every device; like the CUDA runtime, the list ends at the first invalid entry.
    """
    if env_value is None:
        return list(range(physical_count))
    selected: list[int | None] = []
    for entry in (e.strip() for e in env_value.split(",")):
        if entry.startswith(("GPU-", "MIG-")):
            selected.append(None)
        elif entry.isdigit() and int(entry) < physical_count:
            selected.append(int(entry))
        else:
            break
    return selected


def _nvml_gpus() -> list[GpuInfo]:
    import pynvml

    pynvml.nvmlInit()
    try:
        gpus = []
        env_value = os.environ.get("CUDA_VISIBLE_DEVICES")
        for index in visible_devices(pynvml.nvmlDeviceGetCount(), env_value):
            if index is None:
                gpus.append(GpuInfo("GPU selected by UUID", None))
                continue
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            gpus.append(GpuInfo(name.decode() if isinstance(name, bytes) else name, (major, minor)))
        return gpus
    finally:
        pynvml.nvmlShutdown()


def detect() -> CudaEnvironment:
    """Probe this machine; cheap, and creates no CUDA context."""
    cuda, hip = torch.version.cuda, getattr(torch.version, "hip", None)
    triton_version = package_version("triton") if triton_installed() else None
    base = dict(
        torch_version=torch.__version__,
        cuda_version=cuda,
        hip_version=hip,
        triton_version=triton_version,
    )
    if cuda is None:
        return CudaEnvironment(**base, device_count=0, count_source="torch build")
    try:
        gpus = _nvml_gpus()
    except ImportError:
        count = torch.cuda.device_count()
        problem = None
        if torch.cuda.is_initialized():
            problem = "torch.cuda.device_count() initialised CUDA in the probing process"
        return CudaEnvironment(
            **base, device_count=count, count_source="torch.cuda.device_count", problem=problem
        )
    except Exception as exc:  # NVMLError and its many subclasses: no driver, no permission
        return CudaEnvironment(**base, device_count=0, count_source="nvml", problem=repr(exc))
    return CudaEnvironment(**base, device_count=len(gpus), count_source="nvml", gpus=tuple(gpus))


def supports_bf16(capabilities: list[tuple[int, int] | None]) -> bool:
    """bf16 needs Ampere or newer on every known GPU (unknown ones are checked at start-up)."""
    return all(cc is None or cc >= BF16_MIN_CAPABILITY for cc in capabilities)


def capabilities_for(gpus: tuple[GpuInfo, ...], cuda_graphs: bool) -> Capabilities:
    """What the backend declares for these GPUs."""
    bf16 = supports_bf16([g.compute_capability for g in gpus])
    features = ("prefix_caching", "chunked_prefill") + (("cuda_graphs",) if cuda_graphs else ())
    return Capabilities(
        dtypes=("float16", "bfloat16", "float32") if bf16 else ("float16", "float32"),
        head_sizes=KERNEL_HEAD_SIZES,
        block_sizes=KERNEL_BLOCK_SIZES,
        max_batch=None,
        features=features,
    )


def _unavailable_reason(env: CudaEnvironment) -> str | None:
    if env.cuda_version is None:
        if env.hip_version is not None:
            return f"torch {env.torch_version} is a ROCm build; the rocm backend serves AMD GPUs"
        return (
            f"torch {env.torch_version} has no CUDA support (a CPU build); install a CUDA "
            "build of torch"
        )
    if env.triton_version is None:
        return "triton is not installed (pip install triton==3.7.1)"
    if env.device_count == 0:
        detail = f": {env.problem}" if env.problem else ""
        return f"no NVIDIA GPU visible (counted by {env.count_source}){detail}"
    return None


def _device_text(env: CudaEnvironment) -> str:
    if env.device_count == 0:
        return "cuda (no GPU)"
    if not env.gpus:
        return f"cuda ({env.device_count} GPU(s))"
    first = env.gpus[0]
    arch = (
        f", sm_{first.compute_capability[0]}{first.compute_capability[1]}"
        if (first.compute_capability)
        else ""
    )
    return f"cuda ({env.device_count} x {first.name}{arch})"


def describe(env: CudaEnvironment, version_text: str, cuda_graphs: bool) -> BackendInfo:
    """The ``BackendInfo`` row for ``env``."""
    problem = _unavailable_reason(env)
    reason = problem or (
        f"{env.device_count} GPU(s) via {env.count_source}; CUDA {env.cuda_version}, "
        f"triton {env.triton_version}" + (f" (warning: {env.problem})" if env.problem else "")
    )
    return BackendInfo(
        name=NAME,
        package=PACKAGE,
        version=version_text,
        api_version=API_VERSION,
        available=problem is None,
        reason=reason,
        priority=PRIORITY,
        device=_device_text(env),
        capabilities=capabilities_for(env.gpus, cuda_graphs),
    )
