"""Finding NVIDIA GPUs without creating a CUDA context in the probing process.

Counts come from NVML (the optional ``nvidia-ml-py`` package) when it is installed, else from
``torch.cuda.device_count()``, which torch answers through NVML too where it can; it never
creates a context, and :func:`detect` checks ``torch.cuda.is_initialized()`` afterwards to prove
it. :func:`describe` turns what was found into the ``BackendInfo`` row, and is a pure function
so every outcome is tested without a GPU.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from platform_core.backend_api import (
    KERNEL_CAPABILITIES,
    BackendIdentity,
    BackendInfo,
    Capabilities,
    count_devices,
    gpu_device_text,
    triton_version,
)

BACKEND = BackendIdentity("cuda", "platform-core-cuda", api_version=(1, 7), priority=100)
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
    base = dict(
        torch_version=torch.__version__,
        cuda_version=cuda,
        hip_version=hip,
        triton_version=triton_version("triton"),
    )
    if cuda is None:
        return CudaEnvironment(**base, device_count=0, count_source="torch build")
    try:
        gpus = _nvml_gpus()
    except ImportError:
        count, problem = count_devices(torch.cuda, "CUDA")
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
    kernels = KERNEL_CAPABILITIES
    bf16 = supports_bf16([g.compute_capability for g in gpus])
    return dataclasses.replace(
        kernels,
        dtypes=kernels.dtypes if bf16 else tuple(d for d in kernels.dtypes if d != "bfloat16"),
        features=kernels.features + (("cuda_graphs",) if cuda_graphs else ()),
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


def _model(env: CudaEnvironment) -> str:
    """The first GPU's name and architecture (``""``: not known)."""
    if not env.gpus:
        return ""
    first, capability = env.gpus[0], env.gpus[0].compute_capability
    return first.name + (f", sm_{capability[0]}{capability[1]}" if capability else "")


def describe(env: CudaEnvironment, version_text: str, cuda_graphs: bool) -> BackendInfo:
    """The ``BackendInfo`` row for ``env``."""
    return BACKEND.row(
        version_text,
        capabilities_for(env.gpus, cuda_graphs),
        gpu_device_text("cuda", env.device_count, _model(env)),
        problem=_unavailable_reason(env),
        ready=f"{env.device_count} GPU(s) via {env.count_source}; CUDA {env.cuda_version}, "
        f"triton {env.triton_version}",
        warning=env.problem,
    )
