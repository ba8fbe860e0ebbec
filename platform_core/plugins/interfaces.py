"""The objects a backend supplies: small ABCs whose docstrings are the contract.

A backend package implements :class:`Backend` (its device, attention ops and memory profiler;
the communicator factory has a default) and describes itself with :class:`BackendInfo`.
Everything here is plain data or small interfaces; no method of the core is ever monkeypatched
by a backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from platform_core.attention.metadata import AttentionMetadata
    from platform_core.config import EngineConfig
    from platform_core.distributed.communicator import Communicator


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend declares it can run; the core checks configs against it.

    ``features`` names optional abilities (``"prefix_caching"``, ``"chunked_prefill"``,
    ``"cuda_graphs"``, ``"fp8_kv"``, ...). ``max_batch`` of ``None`` means unlimited.
    ``preferred_block_size`` is the KV block size used when the user sets none.
    ``auto_float32_dtype`` is the dtype ``dtype="auto"`` runs a float32 checkpoint in (``None``:
    float32), e.g. bf16 where the device computes in it natively (since plugin API 1.1);
    ``auto_dtype_reason`` says why, for the log (since 1.2).
    """

    dtypes: tuple[str, ...]
    head_sizes: tuple[int, ...]
    block_sizes: tuple[int, ...]
    max_batch: int | None = None
    features: tuple[str, ...] = ()
    preferred_block_size: int = 16
    auto_float32_dtype: str | None = None
    auto_dtype_reason: str = ""


@dataclass(frozen=True, slots=True)
class BackendInfo:
    """One row of ``platform-core backends``: every backend reports one, usable or not.

    ``details`` are lines the listing prints under the row: the paths this device runs (kernel
    builds, instruction sets), since plugin API 1.2.
    """

    name: str
    package: str
    version: str
    api_version: tuple[int, int]
    available: bool
    reason: str
    priority: int
    device: str
    capabilities: Capabilities | None = None
    details: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ConfigAdjustment:
    """A change a backend asks the core to make to the config, with the reason (logged)."""

    key: str
    value: Any
    reason: str


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """Device memory as measured by a backend's profiler, in bytes.

    ``peak_bytes`` is the extra memory used at the peak of a dummy forward pass (activations),
    ``weights_bytes`` what the loaded model occupies, ``available_bytes`` what was free before
    the KV cache is allocated.
    """

    device: str
    total_bytes: int
    available_bytes: int
    weights_bytes: int
    peak_bytes: int

    def kv_budget_bytes(self, utilization: float) -> int:
        """Bytes left for the KV cache when using ``utilization`` of the total memory."""
        used_by_others = self.total_bytes - self.available_bytes
        limit = int(self.total_bytes * utilization) - used_by_others - self.peak_bytes
        return max(0, min(limit, self.available_bytes - self.peak_bytes))


class AttentionOps(ABC):
    """Paged-attention kernels of one backend.

    The cache of one layer is a single tensor whose shape the backend chooses through
    :meth:`kv_cache_shape`; the core only allocates it and passes it back. ``write_kv`` mutates
    the cache in place; ``forward`` reads it and mutates nothing.
    """

    @abstractmethod
    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Shape of one layer's KV cache."""

    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` at their slots.

        A slot of ``-1`` marks a padding token: nothing is written for it.
        """

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of ``query`` ``[num_tokens, num_heads, head_size]`` over the cache.

        The batch mixes prefill chunks and decodes (see ``AttentionMetadata``); the K/V of the
        query tokens themselves have already been written by ``write_kv``. Returns
        ``[num_tokens, num_heads, head_size]`` in ``query``'s dtype.
        """

    def copy_blocks(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks ``src[i] -> dst[i]`` (copy-on-write when a sequence forks).

        The default assumes the block index is dimension 1 of the cache; a backend whose layout
        differs overrides it.
        """
        kv_cache[:, dst] = kv_cache[:, src]


class MemoryProfiler(ABC):
    """Measures device memory so the core can size the KV cache."""

    @abstractmethod
    def profile(self, run_dummy_forward: Callable[[], None], weights_bytes: int) -> MemoryReport:
        """Run ``run_dummy_forward`` once and report memory, its peak included."""

    def kv_cache_budget(self, report: MemoryReport, utilization: float) -> int:
        """Bytes to give the KV cache when the user set no ``kv_cache_memory_bytes``."""
        return report.kv_budget_bytes(utilization)


class Backend(ABC):
    """A hardware backend: the device-specific parts only.

    Attributes:
        name: the backend's registered name (``"cpu"``, ``"cuda"``, ...).
        device: the ``torch.device`` tensors live on.
        capabilities: what it declares it can run.
        attention: its paged-attention ops.
        memory: its memory profiler.
        process_group_backend: the torch.distributed backend for multi-rank execution.
    """

    name: str
    device: torch.device
    capabilities: Capabilities
    attention: AttentionOps
    memory: MemoryProfiler
    #: torch.distributed backend its communicator runs on ("gloo", "nccl", "xccl", ...)
    process_group_backend: str = "gloo"

    def communicator(self, group: Any = None) -> Communicator:
        """A communicator over ``group`` (``None``: the default process group).

        The default (since plugin API 1.3) is a ``TorchDistributedCommunicator`` on this
        backend's device, which works over any ``torch.distributed`` backend; override it only
        for collectives outside ``torch.distributed``.
        """
        # Imported here: importing the interfaces (a backend's probe does) must not import torch.
        from platform_core.distributed.communicator import TorchDistributedCommunicator

        return TorchDistributedCommunicator(group=group, device=self.device)

    def synchronize(self) -> None:  # noqa: B027 - optional hook, a no-op for synchronous devices
        """Wait for queued device work; a no-op on synchronous devices."""

    def before_step(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Called before each step's forward, on the thread that runs it, on every rank (since
        plugin API 1.4). The CPU backend fits its thread count to the cores other processes
        leave free here."""

    def op_overrides(self) -> dict[str, Callable[..., Any]]:
        """Optional ops by name, one of ``OVERRIDABLE_OPS`` (``"rms_norm"``, ``"rotary"``,
        ``"silu_and_mul"``, ``"linear"``, ``"argmax"``, ``"quantized_linear"``,
        ``"apply_token_bitmask"`` since plugin API 1.5, ``"lora_shrink"`` and ``"lora_expand"``
        since 1.6); their signatures are ``RmsNormFn``, ``RotaryFn``, ``SiluAndMulFn``,
        ``LinearFn``, ``ArgmaxFn``, ``QuantizedLinearFn``, ``TokenBitmaskFn``, ``LoRAShrinkFn``
        and ``LoRAExpandFn`` of the backend API."""
        return {}

    def adjust_config(self, config: EngineConfig) -> list[ConfigAdjustment]:
        """Config changes this backend needs; the core applies and logs each one."""
        return []

    def graph_runner(
        self,
        model: Callable[..., torch.Tensor],
        kv_caches: list[torch.Tensor],
        config: EngineConfig,
        max_model_len: int,
    ) -> Callable[..., torch.Tensor] | None:
        """A stand-in for ``model``'s forward (same signature) that replays captured device
        graphs for the steps it can, or ``None`` to run every step eagerly (the default).

        Called once, after the KV cache is allocated: ``kv_caches`` are the tensors every step
        passes. ``config.model.enforce_eager`` asks for ``None``.
        """
        return None
