"""The backend API: every name a backend package or the conformance suite imports from the core.

The backends (``backends/*``, ``examples/backend-template``) and ``platform_core_conformance``
import from here and from the top-level ``platform_core`` (``LLM``, ``SamplingParams``) only, so
the modules behind these names may move without breaking them. What the hooks promise and how
the contract is versioned is in :mod:`platform_core.plugins.hookspecs`.

Importing this module is cheap, as a probe needs: the contract's types, errors and probe helpers
are imported with it; the names that need torch (or triton, or yaml) are imported from their
modules on first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from platform_core.errors import (
    BackendError,
    ConfigError,
    PlatformCoreError,
    UnsupportedByBackendError,
)
from platform_core.kernels.triton import (
    KERNEL_CAPABILITIES,
    triton_installed,
    triton_interpreting,
    triton_version,
)
from platform_core.plugins.hookspecs import (
    PLUGIN_API_VERSION,
    HookDeprecationWarning,
    api_compatible,
    api_note,
    format_api_version,
    hookimpl,
)
from platform_core.plugins.identity import BackendIdentity, installed_version
from platform_core.plugins.interfaces import (
    AttentionOps,
    Backend,
    BackendInfo,
    Capabilities,
    ConfigAdjustment,
    MemoryProfiler,
    MemoryReport,
)

if TYPE_CHECKING:
    from platform_core.attention.metadata import AttentionMetadata
    from platform_core.attention.reference import (
        ReferenceAttentionOps,
        reference_export_blocks,
        reference_import_blocks,
        reference_kv_cache_shape,
        reference_paged_attention,
        reference_write_kv,
    )
    from platform_core.config import EngineConfig
    from platform_core.distributed.communicator import Communicator, TorchDistributedCommunicator
    from platform_core.distributed.launch import (
        LoopbackGroupConfig,
        find_free_port,
        init_loopback_process_group,
    )
    from platform_core.kernels.triton.launch import LaunchParams, choose_num_splits
    from platform_core.kernels.triton.ops import TritonAttentionOps, triton_op_overrides
    from platform_core.layers.activation import SiluAndMulFn, silu_and_mul
    from platform_core.layers.argmax import ArgmaxFn, row_argmax
    from platform_core.layers.linear import LinearFn
    from platform_core.layers.lora import (
        LoRAExpandFn,
        LoRAMapping,
        LoRASegment,
        LoRAShrinkFn,
        check_lora_expand_args,
        check_lora_shrink_args,
        lora_expand,
        lora_shrink,
    )
    from platform_core.layers.norm import RmsNormFn, rms_norm
    from platform_core.layers.ops import OVERRIDABLE_OPS, LayerOps, resolve_ops
    from platform_core.layers.rotary import RotaryFn, apply_rotary
    from platform_core.layers.token_bitmask import TokenBitmaskFn, apply_token_bitmask
    from platform_core.plugins.accelerator import (
        AcceleratorBackend,
        CachingAllocatorProfiler,
        count_devices,
        gpu_device_text,
        require_available,
    )
    from platform_core.plugins.manager import PluginManager
    from platform_core.quantization.formats import (
        ALL_QUANT_FORMATS,
        FP8_E4M3,
        QUANT_FORMATS,
        QuantFormat,
        QuantizedLinearFn,
        dequantize,
        quantized_linear,
        random_blocks,
    )

__all__ = [  # noqa: RUF022 - grouped by topic, not sorted
    # the plugin contract (platform_core.plugins.hookspecs, .interfaces)
    "PLUGIN_API_VERSION",
    "hookimpl",
    "api_compatible",
    "api_note",
    "format_api_version",
    "HookDeprecationWarning",
    "Backend",
    "BackendInfo",
    "Capabilities",
    "ConfigAdjustment",
    "AttentionOps",
    "MemoryProfiler",
    "MemoryReport",
    "AttentionMetadata",
    "EngineConfig",
    # errors
    "PlatformCoreError",
    "ConfigError",
    "BackendError",
    "UnsupportedByBackendError",
    # collectives
    "Communicator",
    "TorchDistributedCommunicator",
    "LoopbackGroupConfig",
    "find_free_port",
    "init_loopback_process_group",
    # reference attention (the oracle)
    "ReferenceAttentionOps",
    "reference_kv_cache_shape",
    "reference_paged_attention",
    "reference_write_kv",
    "reference_export_blocks",
    "reference_import_blocks",
    # overridable ops: the table, the defaults and their signatures
    "OVERRIDABLE_OPS",
    "LayerOps",
    "resolve_ops",
    "rms_norm",
    "RmsNormFn",
    "apply_rotary",
    "RotaryFn",
    "silu_and_mul",
    "SiluAndMulFn",
    "LinearFn",
    "row_argmax",
    "ArgmaxFn",
    "apply_token_bitmask",
    "TokenBitmaskFn",
    "lora_shrink",
    "LoRAShrinkFn",
    "lora_expand",
    "LoRAExpandFn",
    "LoRAMapping",
    "LoRASegment",
    "check_lora_shrink_args",
    "check_lora_expand_args",
    "quantized_linear",
    "QuantizedLinearFn",
    "QuantFormat",
    "QUANT_FORMATS",
    "FP8_E4M3",
    "ALL_QUANT_FORMATS",
    "dequantize",
    "random_blocks",
    # the Triton kernels shared by the GPU backends
    "KERNEL_CAPABILITIES",
    "triton_installed",
    "triton_interpreting",
    "triton_version",
    "LaunchParams",
    "choose_num_splits",
    "TritonAttentionOps",
    "triton_op_overrides",
    # what GPU-like backends share
    "AcceleratorBackend",
    "CachingAllocatorProfiler",
    "count_devices",
    "gpu_device_text",
    "require_available",
    # discovery, the fixed part of probe rows, versions
    "PluginManager",
    "BackendIdentity",
    "installed_version",
]

# The names that import torch, triton or yaml, by the module they are imported from when used.
_LAZY = {
    "AttentionMetadata": "platform_core.attention.metadata",
    "EngineConfig": "platform_core.config",
    "Communicator": "platform_core.distributed.communicator",
    "TorchDistributedCommunicator": "platform_core.distributed.communicator",
    "LoopbackGroupConfig": "platform_core.distributed.launch",
    "find_free_port": "platform_core.distributed.launch",
    "init_loopback_process_group": "platform_core.distributed.launch",
    "ReferenceAttentionOps": "platform_core.attention.reference",
    "reference_kv_cache_shape": "platform_core.attention.reference",
    "reference_paged_attention": "platform_core.attention.reference",
    "reference_write_kv": "platform_core.attention.reference",
    "reference_export_blocks": "platform_core.attention.reference",
    "reference_import_blocks": "platform_core.attention.reference",
    "OVERRIDABLE_OPS": "platform_core.layers.ops",
    "LayerOps": "platform_core.layers.ops",
    "resolve_ops": "platform_core.layers.ops",
    "rms_norm": "platform_core.layers.norm",
    "RmsNormFn": "platform_core.layers.norm",
    "apply_rotary": "platform_core.layers.rotary",
    "RotaryFn": "platform_core.layers.rotary",
    "silu_and_mul": "platform_core.layers.activation",
    "SiluAndMulFn": "platform_core.layers.activation",
    "LinearFn": "platform_core.layers.linear",
    "row_argmax": "platform_core.layers.argmax",
    "ArgmaxFn": "platform_core.layers.argmax",
    "apply_token_bitmask": "platform_core.layers.token_bitmask",
    "TokenBitmaskFn": "platform_core.layers.token_bitmask",
    "lora_shrink": "platform_core.layers.lora",
    "LoRAShrinkFn": "platform_core.layers.lora",
    "lora_expand": "platform_core.layers.lora",
    "LoRAExpandFn": "platform_core.layers.lora",
    "LoRAMapping": "platform_core.layers.lora",
    "LoRASegment": "platform_core.layers.lora",
    "check_lora_shrink_args": "platform_core.layers.lora",
    "check_lora_expand_args": "platform_core.layers.lora",
    "quantized_linear": "platform_core.quantization.formats",
    "QuantizedLinearFn": "platform_core.quantization.formats",
    "QuantFormat": "platform_core.quantization.formats",
    "QUANT_FORMATS": "platform_core.quantization.formats",
    "FP8_E4M3": "platform_core.quantization.formats",
    "ALL_QUANT_FORMATS": "platform_core.quantization.formats",
    "dequantize": "platform_core.quantization.formats",
    "random_blocks": "platform_core.quantization.formats",
    "LaunchParams": "platform_core.kernels.triton.launch",
    "choose_num_splits": "platform_core.kernels.triton.launch",
    "TritonAttentionOps": "platform_core.kernels.triton.ops",
    "triton_op_overrides": "platform_core.kernels.triton.ops",
    "AcceleratorBackend": "platform_core.plugins.accelerator",
    "CachingAllocatorProfiler": "platform_core.plugins.accelerator",
    "count_devices": "platform_core.plugins.accelerator",
    "gpu_device_text": "platform_core.plugins.accelerator",
    "require_available": "platform_core.plugins.accelerator",
    "PluginManager": "platform_core.plugins.manager",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
