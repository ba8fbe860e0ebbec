"""Finding AMD GPUs through a ROCm build of torch, without initialising torch's GPU state.

``torch.cuda.device_count()`` on ROCm counts through amdsmi when it is installed, else asks the
HIP runtime; neither initialises torch's CUDA state, which :func:`detect` verifies with
``torch.cuda.is_initialized()``. :func:`describe` is pure, so every outcome is tested without a
GPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from platform_core.backend_api import (
    KERNEL_CAPABILITIES,
    BackendIdentity,
    BackendInfo,
    count_devices,
    gpu_device_text,
    triton_version,
)

BACKEND = BackendIdentity("rocm", "platform-core-rocm", api_version=(1, 7), priority=100)
CAPABILITIES = KERNEL_CAPABILITIES
_TRITON_DISTRIBUTIONS = ("pytorch-triton-rocm", "triton")


@dataclass(frozen=True, slots=True)
class RocmEnvironment:
    """What probing found: torch's build, its Triton, and the GPU count."""

    torch_version: str
    hip_version: str | None
    cuda_version: str | None
    triton_version: str | None
    device_count: int
    problem: str | None = None


def detect() -> RocmEnvironment:
    """Probe this machine; cheap, and creates no HIP context."""
    hip = getattr(torch.version, "hip", None)
    env = RocmEnvironment(
        torch_version=torch.__version__,
        hip_version=hip,
        cuda_version=torch.version.cuda,
        triton_version=triton_version(*_TRITON_DISTRIBUTIONS),
        device_count=0,
    )
    if hip is None:
        return env
    count, problem = count_devices(torch.cuda, "HIP")
    return dataclasses.replace(env, device_count=count, problem=problem)


def _unavailable_reason(env: RocmEnvironment) -> str | None:
    if env.hip_version is None:
        if env.cuda_version is not None:
            return f"torch {env.torch_version} is a CUDA build; the cuda backend serves NVIDIA GPUs"
        return (
            f"torch {env.torch_version} has no ROCm support (a CPU build); install a ROCm "
            "build of torch"
        )
    if env.triton_version is None:
        return "triton is not installed (a ROCm build of torch brings pytorch-triton-rocm)"
    if env.device_count == 0:
        return "no AMD GPU visible" + (f": {env.problem}" if env.problem else "")
    return None


def describe(env: RocmEnvironment, version_text: str) -> BackendInfo:
    """The ``BackendInfo`` row for ``env``."""
    return BACKEND.row(
        version_text,
        CAPABILITIES,
        gpu_device_text("rocm", env.device_count),
        problem=_unavailable_reason(env),
        ready=f"{env.device_count} GPU(s); HIP {env.hip_version}, triton {env.triton_version}",
        warning=env.problem,
    )
