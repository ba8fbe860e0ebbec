"""pluggy hooks and the ``Backend`` object of the AMD ROCm backend.

ROCm's torch exposes HIP through the ``torch.cuda`` API and the ``cuda`` device type, so device,
memory and collectives (torch's ``nccl`` backend is RCCL here) use those names; what differs
from the CUDA backend is detection and the Triton launch settings.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from platform_core.config import EngineConfig
from platform_core.errors import BackendError
from platform_core.kernels.triton.launch import LaunchParams
from platform_core.plugins.hookspecs import hookimpl
from platform_core.plugins.interfaces import Backend, BackendInfo
from platform_core_rocm.probe import (
    CAPABILITIES,
    NAME,
    PACKAGE,
    describe,
    detect,
    installed_version,
)


def rocm_launch_params(num_compute_units: int) -> LaunchParams:
    """Triton launch settings for an AMD GPU with ``num_compute_units`` CUs.

    Key tiles of 64 match the 64-lane wavefront; one pipeline stage and two waves per EU leave
    registers for the accumulator (AMD's Triton takes ``waves_per_eu``).
    """
    return LaunchParams(
        block_m=64,
        block_n=64,
        num_warps=4,
        num_stages=1,
        target_programs=2 * num_compute_units,
        options=(("waves_per_eu", 2),),
    )


class RocmBackend(Backend):
    """One AMD GPU: ``cuda:$LOCAL_RANK`` in torch's naming (0 when unset)."""

    process_group_backend = "nccl"

    def __init__(self) -> None:
        from platform_core.kernels.device_memory import CachingAllocatorProfiler
        from platform_core.kernels.triton.ops import TritonAttentionOps

        self.name = NAME
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(self.device)
        props = torch.cuda.get_device_properties(self.device)
        self.capabilities = CAPABILITIES
        self.attention = TritonAttentionOps(rocm_launch_params(props.multi_processor_count))
        self.memory = CachingAllocatorProfiler(torch.cuda, self.device)

    def communicator(self, group: Any = None):
        from platform_core.distributed.communicator import TorchDistributedCommunicator

        return TorchDistributedCommunicator(group=group, device=self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


@hookimpl
def platform_core_backend_info() -> BackendInfo:
    return describe(detect(), installed_version((PACKAGE,)))


@hookimpl
def platform_core_create_backend(name: str, config: EngineConfig) -> Backend | None:
    if name != NAME:
        return None
    info = platform_core_backend_info()
    if not info.available:
        raise BackendError(f"backend 'rocm' is not available: {info.reason}")
    return RocmBackend()
