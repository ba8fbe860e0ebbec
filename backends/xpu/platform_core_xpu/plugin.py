"""pluggy hooks and the ``Backend`` object of the Intel XPU backend.

Attention is IPEX's when a matching IPEX is installed, else the shared Triton kernels on Intel's
Triton; the choice and its reason are logged when the backend is created. Memory is profiled
through ``torch.xpu``'s allocator; collectives use torch's ``xccl`` backend.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from platform_core.config import EngineConfig
from platform_core.errors import BackendError
from platform_core.kernels.triton.launch import LaunchParams
from platform_core.plugins.hookspecs import hookimpl
from platform_core.plugins.interfaces import AttentionOps, Backend, BackendInfo
from platform_core_xpu.probe import (
    CAPABILITIES,
    NAME,
    PACKAGE,
    AttentionChoice,
    choose_attention,
    describe,
    detect,
    installed_version,
)

logger = logging.getLogger("platform_core_xpu")


def xpu_launch_params(num_xe_cores: int) -> LaunchParams:
    """Triton launch settings for an Intel GPU with ``num_xe_cores`` Xe-cores (0: unknown,
    which turns split-KV off)."""
    return LaunchParams(
        block_m=64, block_n=64, num_warps=8, num_stages=2, target_programs=2 * num_xe_cores
    )


def build_attention(choice: AttentionChoice, num_xe_cores: int) -> AttentionOps:
    """The attention ops for ``choice``, logging which path runs and why."""
    if choice.kind == "ipex":
        from platform_core_xpu.ipex_attention import IpexAttentionOps

        logger.info("XPU attention: IPEX paged attention (%s)", choice.reason)
        return IpexAttentionOps()
    if choice.kind == "triton":
        from platform_core.kernels.triton.ops import TritonAttentionOps

        logger.info("XPU attention: Triton kernels (%s)", choice.reason)
        return TritonAttentionOps(xpu_launch_params(num_xe_cores))
    raise BackendError(f"backend 'xpu' has no paged attention: {choice.reason}")


class XpuBackend(Backend):
    """One Intel GPU: ``xpu:$LOCAL_RANK`` (0 when unset)."""

    process_group_backend = "xccl"

    def __init__(self, choice: AttentionChoice) -> None:
        from platform_core.kernels.device_memory import CachingAllocatorProfiler

        self.name = NAME
        self.device = torch.device("xpu", int(os.environ.get("LOCAL_RANK", "0")))
        torch.xpu.set_device(self.device)
        props = torch.xpu.get_device_properties(self.device)
        self.capabilities = CAPABILITIES
        self.attention = build_attention(choice, getattr(props, "gpu_subslice_count", 0))
        self.memory = CachingAllocatorProfiler(torch.xpu, self.device)

    def communicator(self, group: Any = None):
        from platform_core.distributed.communicator import TorchDistributedCommunicator

        return TorchDistributedCommunicator(group=group, device=self.device)

    def synchronize(self) -> None:
        torch.xpu.synchronize(self.device)


@hookimpl
def platform_core_backend_info() -> BackendInfo:
    return describe(detect(), installed_version((PACKAGE,)) or "unknown")


@hookimpl
def platform_core_create_backend(name: str, config: EngineConfig) -> Backend | None:
    if name != NAME:
        return None
    env = detect()
    info = describe(env, installed_version((PACKAGE,)) or "unknown")
    if not info.available:
        raise BackendError(f"backend 'xpu' is not available: {info.reason}")
    return XpuBackend(choose_attention(env))
