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

from platform_core.errors import UnsupportedByBackendError

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

    def export_blocks(
        self, kv_cache: torch.Tensor, block_ids: torch.Tensor, *, block_size: int, head_size: int
    ) -> torch.Tensor:
        """Blocks ``block_ids`` of one layer's cache in the canonical layout (since plugin API
        1.7): a new tensor ``[2, n, block_size, num_kv_heads, head_size]`` (0 keys, 1 values,
        tokens in order) in the cache's dtype and on its device; KV connectors move blocks in it
        between instances that may run different backends. Mutates nothing.

        ``block_ids`` is an int64 tensor on the cache's device, in any order, possibly empty.
        ``block_size`` and ``head_size`` are the cache's, as given to :meth:`kv_cache_shape`
        (a backend's layout need not show them). Invalid arguments raise ``ValueError``.

        The default serves the canonical layout only (the reference's and the Triton kernels');
        for any other cache it raises ``UnsupportedByBackendError``: a backend whose layout
        differs overrides both this and :meth:`import_blocks`.
        """
        self._require_canonical_layout(kv_cache)
        self.check_block_ids(block_ids, kv_cache.shape[1])
        cached = (kv_cache.shape[2], kv_cache.shape[4])
        if cached != (block_size, head_size):
            raise ValueError(
                f"block_size {block_size} and head_size {head_size} are not the cache's: its "
                f"shape {tuple(kv_cache.shape)} has block_size {cached[0]}, head_size {cached[1]}"
            )
        return kv_cache.index_select(1, block_ids)

    def import_blocks(
        self, kv_cache: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor
    ) -> None:
        """Write canonical ``blocks`` ``[2, n, block_size, num_kv_heads, head_size]`` into the
        cache at ``block_ids`` (since plugin API 1.7): the inverse of :meth:`export_blocks`.

        ``block_ids`` are distinct; ``blocks`` may have another dtype or device and is converted
        to the cache's. Other blocks are unchanged. Invalid arguments raise ``ValueError``; the
        default raises ``UnsupportedByBackendError`` for a layout other than the canonical one.
        """
        self._require_canonical_layout(kv_cache)
        self.check_block_ids(block_ids, kv_cache.shape[1], distinct=True)
        geometry = self.check_canonical_blocks(blocks, block_ids.numel())
        if geometry != tuple(kv_cache.shape[2:]):
            raise ValueError(
                f"blocks of shape {tuple(blocks.shape)} do not fit a cache of shape "
                f"{tuple(kv_cache.shape)}: [block_size, num_kv_heads, head_size] differ"
            )
        kv_cache.index_copy_(1, block_ids, blocks.to(kv_cache.device, kv_cache.dtype))

    def _require_canonical_layout(self, kv_cache: torch.Tensor) -> None:
        """Refuse a cache the defaults would misread (they index the canonical layout)."""
        if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
            raise UnsupportedByBackendError(
                type(self).__qualname__,
                "kv_cache_shape",
                tuple(kv_cache.shape),
                "[2, num_blocks, block_size, num_kv_heads, head_size] only: this KV layout "
                "differs from the canonical one, so the ops must override export_blocks and "
                "import_blocks for KV transfer",
            )

    @staticmethod
    def check_block_ids(
        block_ids: torch.Tensor, num_blocks: int, *, distinct: bool = False
    ) -> None:
        """Raise ``ValueError`` unless ``block_ids`` is a 1-D int64 tensor of ids in
        ``[0, num_blocks)`` (and, with ``distinct``, no id twice); for overrides of
        :meth:`export_blocks` and :meth:`import_blocks` (since plugin API 1.7)."""
        import torch  # here: importing the interfaces must not import torch

        if block_ids.dim() != 1 or block_ids.dtype != torch.int64:
            raise ValueError(
                f"block_ids must be a 1-D int64 tensor, not {block_ids.dim()}-D {block_ids.dtype}"
            )
        if not block_ids.numel():
            return
        low, high = torch.stack(block_ids.aminmax()).tolist()  # one device sync for both
        if low < 0 or high >= num_blocks:
            outside = block_ids[(block_ids < 0) | (block_ids >= num_blocks)]
            raise ValueError(
                f"block ids {outside[:8].tolist()} are out of range: the cache has "
                f"{num_blocks} blocks"
            )
        if distinct and block_ids.unique().numel() != block_ids.numel():
            raise ValueError(f"block ids repeat: {block_ids.tolist()[:64]}")

    @staticmethod
    def check_canonical_blocks(blocks: torch.Tensor, count: int) -> tuple[int, int, int]:
        """``(block_size, num_kv_heads, head_size)`` of ``blocks`` after checking that they are
        ``count`` canonical blocks ``[2, count, block_size, num_kv_heads, head_size]``, else
        ``ValueError`` (since plugin API 1.7)."""
        if blocks.dim() != 5 or tuple(blocks.shape[:2]) != (2, count):
            raise ValueError(
                f"blocks of shape {tuple(blocks.shape)} are not {count} canonical blocks "
                f"[2, {count}, block_size, num_kv_heads, head_size]"
            )
        return tuple(blocks.shape[2:])


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
