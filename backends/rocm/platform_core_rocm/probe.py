"""Finding AMD GPUs through a ROCm build of torch, without initialising torch's GPU state.

``torch.cuda.device_count()`` on ROCm counts through amdsmi when it is installed, else asks the
HIP runtime; neither initialises torch's CUDA state, which :func:`detect` verifies with
``torch.cuda.is_initialized()``. :func:`describe` is pure, so every outcome is tested without a
GPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

import torch

from platform_core.kernels.triton import (
    KERNEL_BLOCK_SIZES,
    KERNEL_DTYPES,
    KERNEL_HEAD_SIZES,
    triton_installed,
)
from platform_core.plugins.interfaces import BackendInfo, Capabilities

NAME = "rocm"
PACKAGE = "platform-core-rocm"
API_VERSION = (1, 0)
PRIORITY = 100
CAPABILITIES = Capabilities(
    dtypes=KERNEL_DTYPES,
    head_sizes=KERNEL_HEAD_SIZES,
    block_sizes=KERNEL_BLOCK_SIZES,
    max_batch=None,
    features=("prefix_caching", "chunked_prefill"),
)
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


def installed_version(distributions: tuple[str, ...]) -> str:
    """Version of the first installed distribution of ``distributions``, or ``"unknown"``."""
    for distribution in distributions:
        try:
            return version(distribution)
        except PackageNotFoundError:
            continue
    return "unknown"


def detect() -> RocmEnvironment:
    """Probe this machine; cheap, and creates no HIP context."""
    hip = getattr(torch.version, "hip", None)
    env = RocmEnvironment(
        torch_version=torch.__version__,
        hip_version=hip,
        cuda_version=torch.version.cuda,
        triton_version=installed_version(_TRITON_DISTRIBUTIONS) if triton_installed() else None,
        device_count=0,
    )
    if hip is None:
        return env
    count = torch.cuda.device_count()
    problem = None
    if torch.cuda.is_initialized():
        problem = "torch.cuda.device_count() initialised HIP in the probing process"
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
    problem = _unavailable_reason(env)
    reason = problem or (
        f"{env.device_count} GPU(s); HIP {env.hip_version}, triton {env.triton_version}"
        + (f" (warning: {env.problem})" if env.problem else "")
    )
    return BackendInfo(
        name=NAME,
        package=PACKAGE,
        version=version_text,
        api_version=API_VERSION,
        available=problem is None,
        reason=reason,
        priority=PRIORITY,
        device=f"rocm ({env.device_count} GPU(s))" if env.device_count else "rocm (no GPU)",
        capabilities=CAPABILITIES,
    )
