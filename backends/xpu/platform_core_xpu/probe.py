"""Finding Intel GPUs through an XPU build of torch, and choosing the attention path.

``torch.xpu.device_count()`` enumerates devices without initialising torch's XPU state;
:func:`detect` checks ``torch.xpu.is_initialized()`` afterwards to prove it. IPEX is looked up
by its installed metadata, never imported while probing. :func:`describe` and
:func:`choose_attention` are pure, so every outcome is tested without a GPU.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from platform_core.backend_api import (
    KERNEL_CAPABILITIES,
    BackendIdentity,
    BackendInfo,
    count_devices,
    gpu_device_text,
    installed_version,
    triton_version,
)

BACKEND = BackendIdentity("xpu", "platform-core-xpu", api_version=(1, 7), priority=90)
CAPABILITIES = KERNEL_CAPABILITIES
IPEX_DISTRIBUTION = "intel-extension-for-pytorch"
_TRITON_DISTRIBUTIONS = ("pytorch-triton-xpu", "triton")


@dataclass(frozen=True, slots=True)
class XpuEnvironment:
    """What probing found: torch's build, Triton, IPEX (``None``: not installed), devices."""

    torch_version: str
    xpu_compiled: bool
    triton_version: str | None
    ipex_version: str | None
    device_count: int
    problem: str | None = None


@dataclass(frozen=True, slots=True)
class AttentionChoice:
    """Which paged attention runs (``"ipex"``, ``"triton"`` or ``None``: neither) and why."""

    kind: str | None
    reason: str


def _major_minor(text: str) -> tuple[str, ...]:
    return tuple(text.split("+", 1)[0].split(".")[:2])


def detect() -> XpuEnvironment:
    """Probe this machine; cheap, and initialises no XPU state."""
    compiled = bool(getattr(torch, "xpu", None) and torch.xpu._is_compiled())
    ipex = None
    if importlib.util.find_spec("intel_extension_for_pytorch") is not None:
        ipex = installed_version(IPEX_DISTRIBUTION)
    triton = triton_version(*_TRITON_DISTRIBUTIONS)
    count, problem = count_devices(torch.xpu, "XPU") if compiled else (0, None)
    return XpuEnvironment(torch.__version__, compiled, triton, ipex, count, problem)


def choose_attention(env: XpuEnvironment) -> AttentionChoice:
    """IPEX's paged attention when it matches torch's major.minor, else the Triton kernels."""
    if env.ipex_version is None:
        why_not_ipex = f"{IPEX_DISTRIBUTION} is not installed"
    elif _major_minor(env.ipex_version) != _major_minor(env.torch_version):
        why_not_ipex = (
            f"{IPEX_DISTRIBUTION} {env.ipex_version} does not match torch {env.torch_version} "
            "(major.minor must be equal)"
        )
    else:
        return AttentionChoice(
            "ipex", f"{IPEX_DISTRIBUTION} {env.ipex_version} matches torch {env.torch_version}"
        )
    if env.triton_version is None:
        return AttentionChoice(None, f"{why_not_ipex}, and triton (pytorch-triton-xpu) is missing")
    return AttentionChoice("triton", f"{why_not_ipex}; using the Triton kernels")


def _unavailable_reason(env: XpuEnvironment, choice: AttentionChoice) -> str | None:
    if not env.xpu_compiled:
        return f"torch {env.torch_version} has no XPU support; install an XPU build of torch"
    if env.device_count == 0:
        return "no Intel GPU visible" + (f": {env.problem}" if env.problem else "")
    if choice.kind is None:
        return f"no paged attention available: {choice.reason}"
    return None


def describe(env: XpuEnvironment, version_text: str) -> BackendInfo:
    """The ``BackendInfo`` row for ``env``."""
    choice = choose_attention(env)
    return BACKEND.row(
        version_text,
        CAPABILITIES,
        gpu_device_text("xpu", env.device_count),
        problem=_unavailable_reason(env, choice),
        ready=f"{env.device_count} GPU(s); attention: {choice.kind} ({choice.reason})",
        warning=env.problem,
    )
