"""pluggy hooks and the ``Backend`` object of the Intel XPU backend.

Attention is IPEX's when a matching IPEX is installed, else the shared Triton kernels on Intel's
Triton; the choice and its reason are logged when the backend is created. Memory is profiled
through ``torch.xpu``'s allocator; collectives use torch's ``xccl`` backend.
"""

from __future__ import annotations

import logging

import torch

from platform_core.backend_api import (
    AcceleratorBackend,
    AttentionOps,
    Backend,
    BackendError,
    BackendInfo,
    EngineConfig,
    LaunchParams,
    hookimpl,
    installed_version,
    require_available,
    triton_installed,
)
from platform_core_xpu.probe import (
    BACKEND,
    CAPABILITIES,
    AttentionChoice,
    choose_attention,
    describe,
    detect,
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
        from platform_core.backend_api import TritonAttentionOps  # imports triton

        logger.info("XPU attention: Triton kernels (%s)", choice.reason)
        return TritonAttentionOps(xpu_launch_params(num_xe_cores))
    raise BackendError(f"backend 'xpu' has no paged attention: {choice.reason}")


class XpuBackend(AcceleratorBackend):
    """One Intel GPU: ``xpu:$LOCAL_RANK`` (0 when unset); collectives over XCCL."""

    process_group_backend = "xccl"

    def __init__(self, choice: AttentionChoice) -> None:
        super().__init__(BACKEND.name, "xpu", torch.xpu)
        self.capabilities = CAPABILITIES
        xe_cores = getattr(self.properties, "gpu_subslice_count", 0)
        self.attention = build_attention(choice, xe_cores)
        if triton_installed():  # the quantized linear's kernel (IPEX has none we use)
            from platform_core.backend_api import triton_op_overrides  # imports triton

            self.layer_ops = triton_op_overrides()


@hookimpl
def platform_core_backend_info() -> BackendInfo:
    return describe(detect(), installed_version(BACKEND.package))


@hookimpl
def platform_core_create_backend(name: str, config: EngineConfig) -> Backend | None:
    if name != BACKEND.name:
        return None
    env = detect()
    require_available(describe(env, installed_version(BACKEND.package)))
    return XpuBackend(choose_attention(env))
