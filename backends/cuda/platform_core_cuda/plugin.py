"""pluggy hooks and the ``Backend`` object of the NVIDIA CUDA backend.

Attention runs the shared Triton kernels (``TritonAttentionOps`` of the backend API) with launch
parameters sized to the GPU; memory is profiled through ``torch.cuda``'s allocator; collectives
go through NCCL. ``PLATFORM_CORE_CUDA_GRAPHS=0`` turns CUDA-graph capture of decode steps off.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from platform_core.backend_api import (
    AcceleratorBackend,
    Backend,
    BackendInfo,
    ConfigAdjustment,
    EngineConfig,
    LaunchParams,
    hookimpl,
    installed_version,
    require_available,
)
from platform_core_cuda.probe import (
    BACKEND,
    BF16_MIN_CAPABILITY,
    GpuInfo,
    capabilities_for,
    describe,
    detect,
)

GRAPHS_ENV = "PLATFORM_CORE_CUDA_GRAPHS"


def graphs_enabled() -> bool:
    """CUDA graphs are on unless ``PLATFORM_CORE_CUDA_GRAPHS=0``."""
    return os.environ.get(GRAPHS_ENV, "1") != "0"


def cuda_launch_params(num_sms: int) -> LaunchParams:
    """Triton launch settings for an NVIDIA GPU with ``num_sms`` multiprocessors.

    Split-KV kicks in when a launch has fewer than two programs per SM. Chosen by
    ``benchmarks/gpu_attention.py --sweep`` on an H200 (benchmarks/RESULTS.md): 128-key steps
    and up to 64 splits lift decode over long contexts (1 x 65536 keys: 204 -> 139 us).
    """
    return LaunchParams(
        block_m=64,
        block_n=128,
        num_warps=4,
        num_stages=2,
        target_programs=2 * num_sms,
        max_splits=64,
    )


def dtype_adjustments(config: EngineConfig, capability: tuple[int, int]) -> list[ConfigAdjustment]:
    """bfloat16 on a GPU older than Ampere becomes float16."""
    if config.model.dtype != "bfloat16" or capability >= BF16_MIN_CAPABILITY:
        return []
    return [
        ConfigAdjustment(
            "dtype",
            "float16",
            "bfloat16 needs compute capability 8.0+, this GPU is "
            f"sm_{capability[0]}{capability[1]}",
        )
    ]


class CudaBackend(AcceleratorBackend):
    """One NVIDIA GPU: ``cuda:$LOCAL_RANK`` (0 when unset); collectives over NCCL."""

    process_group_backend = "nccl"

    def __init__(self) -> None:
        from platform_core.backend_api import (  # imports triton
            TritonAttentionOps,
            triton_op_overrides,
        )

        super().__init__(BACKEND.name, "cuda", torch.cuda)
        props = self.properties
        self.compute_capability = (props.major, props.minor)
        gpu = GpuInfo(props.name, self.compute_capability)
        self.capabilities = capabilities_for((gpu,), graphs_enabled())
        self.attention = TritonAttentionOps(cuda_launch_params(props.multi_processor_count))
        self.layer_ops = triton_op_overrides()

    def adjust_config(self, config: EngineConfig) -> list[ConfigAdjustment]:
        return dtype_adjustments(config, self.compute_capability)

    def graph_runner(
        self, model: Any, kv_caches: list[torch.Tensor], config: EngineConfig, max_model_len: int
    ):
        """A captured :class:`~platform_core_cuda.graph_runner.CudaGraphRunner` wrapping
        ``model``'s forward (same signature), or ``None`` when graphs are turned off
        (``enforce_eager`` or ``PLATFORM_CORE_CUDA_GRAPHS=0``)."""
        if config.model.enforce_eager or not graphs_enabled():
            return None
        from platform_core_cuda.graph_buckets import capture_sizes
        from platform_core_cuda.graph_runner import CudaGraphRunner

        runner = CudaGraphRunner(
            model,
            kv_caches,
            self.attention,
            capture_sizes(config.scheduler.max_num_seqs),
            max_model_len,
            config.cache.block_size,
            model.num_kv_heads,
            self.device,
        )
        runner.capture()
        return runner


@hookimpl
def platform_core_backend_info() -> BackendInfo:
    return describe(detect(), installed_version(BACKEND.package), graphs_enabled())


@hookimpl
def platform_core_create_backend(name: str, config: EngineConfig) -> Backend | None:
    if name != BACKEND.name:
        return None
    require_available(platform_core_backend_info())
    return CudaBackend()
