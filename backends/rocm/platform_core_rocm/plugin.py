"""pluggy hooks and the ``Backend`` object of the AMD ROCm backend.

ROCm's torch exposes HIP through the ``torch.cuda`` API and the ``cuda`` device type, so device,
memory and collectives (torch's ``nccl`` backend is RCCL here) use those names; what differs
from the CUDA backend is detection and the Triton launch settings.
"""

from __future__ import annotations

import torch

from platform_core.backend_api import (
    AcceleratorBackend,
    Backend,
    BackendInfo,
    EngineConfig,
    LaunchParams,
    hookimpl,
    installed_version,
    require_available,
)
from platform_core_rocm.probe import BACKEND, CAPABILITIES, describe, detect


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


class RocmBackend(AcceleratorBackend):
    """One AMD GPU: ``cuda:$LOCAL_RANK`` in torch's naming (0 when unset); collectives over
    RCCL (torch's ``nccl`` backend on ROCm)."""

    process_group_backend = "nccl"

    def __init__(self) -> None:
        from platform_core.backend_api import (  # imports triton
            TritonAttentionOps,
            triton_op_overrides,
        )

        super().__init__(BACKEND.name, "cuda", torch.cuda)
        self.capabilities = CAPABILITIES
        units = self.properties.multi_processor_count
        self.attention = TritonAttentionOps(rocm_launch_params(units))
        self.layer_ops = triton_op_overrides()


@hookimpl
def platform_core_backend_info() -> BackendInfo:
    return describe(detect(), installed_version(BACKEND.package))


@hookimpl
def platform_core_create_backend(name: str, config: EngineConfig) -> Backend | None:
    if name != BACKEND.name:
        return None
    require_available(platform_core_backend_info())
    return RocmBackend()
