"""A catalogue of fixture backends for the conformance suite's own tests, registered in-process.

Each is the reference backend (pure-torch attention, the core's default ops) with one bug put in
on purpose, or none (``correct``). They are plugin objects handed to ``run_conformance`` through
``backend_plugins``, so nothing is installed; the engine cannot load them, so their runs select
the kernel, op and registration checks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from platform_core.attention.metadata import AttentionMetadata
from platform_core.attention.reference import ReferenceAttentionOps, reference_write_kv
from platform_core.config import EngineConfig
from platform_core.layers.ops import LayerOps
from platform_core.plugins.hookspecs import PLUGIN_API_VERSION, hookimpl
from platform_core.plugins.interfaces import AttentionOps, Backend, BackendInfo, Capabilities
from platform_core.quantization.formats import QuantFormat, quantized_linear

CAPABILITIES = Capabilities(dtypes=("float32", "bfloat16"), head_sizes=(32,), block_sizes=(16,))
DEFAULT_OPS = {name.name: getattr(LayerOps(), name.name) for name in dataclasses.fields(LayerOps)}


class ScaledAttention(ReferenceAttentionOps):
    """Softmax at a temperature ``factor`` off (a wrong scale constant)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def forward(self, query, kv_cache, metadata, scale):
        return super().forward(query, kv_cache, metadata, scale * self.factor)


class CausalOffByOneAfterPrefix(ReferenceAttentionOps):
    """Sequences with cached tokens place their queries one position early: each query misses
    its own key (a wrong ``seq_len - query_len`` start)."""

    def forward(self, query, kv_cache, metadata: AttentionMetadata, scale):
        starts = metadata.query_start_loc_cpu
        lens = [
            seq_len - 1 if seq_len > starts[i + 1] - starts[i] else seq_len
            for i, seq_len in enumerate(metadata.seq_lens_cpu)
        ]
        return super().forward(
            query, kv_cache, dataclasses.replace(metadata, seq_lens_cpu=lens), scale
        )


class WrongGqaMapping(ReferenceAttentionOps):
    """Query head ``h`` reads KV head ``h % num_kv_heads`` instead of ``h // group``."""

    def forward(self, query, kv_cache, metadata, scale):
        heads, kv_heads = query.shape[1], kv_cache.shape[3]
        group = heads // kv_heads
        # The reference reads KV head h' // group for query head h': put head h at such an h'.
        where = torch.tensor([(h % kv_heads) * group + h // kv_heads for h in range(heads)])
        moved = torch.empty_like(query)
        moved[:, where] = query
        return super().forward(moved, kv_cache, metadata, scale)[:, where]


class PaddingWritten(ReferenceAttentionOps):
    """Writes padding rows (slot ``-1``) into the last slot of the cache."""

    def write_kv(self, key, value, kv_cache, slot_mapping):
        last = kv_cache.shape[1] * kv_cache.shape[2] - 1
        reference_write_kv(key, value, kv_cache, torch.where(slot_mapping < 0, last, slot_mapping))


class Bf16Raises(ReferenceAttentionOps):
    """A bfloat16 path that was never built."""

    def forward(self, query, kv_cache, metadata, scale):
        if query.dtype == torch.bfloat16:
            raise NotImplementedError("bf16 paged attention kernel is missing")
        return super().forward(query, kv_cache, metadata, scale)


def fp16_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Squares in the input's dtype: overflows float16 for |x| above ~256."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rms_norm_without_eps(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Drops epsilon: wrong where the mean square is comparable to it."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True))).to(x.dtype)


def linear_without_bias(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Forgets the bias."""
    return F.linear(x, weight)


def quantized_linear_without_offset(
    x: torch.Tensor, qweight: torch.Tensor, fmt: QuantFormat, bias: torch.Tensor | None
) -> torch.Tensor:
    """Reads Q4_1 as if its blocks had no offset ``m`` (a Q4_0 kernel reused)."""
    if fmt.name == "Q4_1":
        qweight = qweight.clone()
        qweight.unflatten(1, (-1, fmt.block_bytes))[..., 2:4] = 0  # float16 zero
    return quantized_linear(x, qweight, fmt, bias)


def quantized_linear_on_8bit_inputs(
    x: torch.Tensor, qweight: torch.Tensor, fmt: QuantFormat, bias: torch.Tensor | None
) -> torch.Tensor:
    """Rounds every 32 inputs to 8 bits with one scale first, as integer-dot kernels do (a
    row's last inputs short of 32, as FP8 rows may have, as a group of their own)."""
    inputs = x.shape[-1]
    padded = F.pad(x.float(), (0, -inputs % 32))
    groups = padded.unflatten(-1, (-1, 32))
    scale = groups.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
    rounded = ((groups / scale).round() * scale).flatten(-2)[..., :inputs].to(x.dtype)
    return quantized_linear(rounded, qweight, fmt, bias)


@dataclass
class FixtureBackend(Backend):
    """The reference backend with the given attention ops and op overrides."""

    name: str
    capabilities: Capabilities
    attention: AttentionOps
    overrides: dict[str, Callable[..., Any]]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    memory: Any = None  # the selected checks never profile

    def op_overrides(self) -> dict[str, Callable[..., Any]]:
        return dict(self.overrides)


@dataclass
class FixturePlugin:
    """A backend plugin object (hooks as methods) for one fixture backend."""

    name: str
    attention: Callable[[], AttentionOps] = ReferenceAttentionOps
    overrides: dict[str, Callable[..., Any]] = field(default_factory=dict)
    capabilities: Capabilities = CAPABILITIES
    api_version: tuple[int, int] = PLUGIN_API_VERSION

    @hookimpl
    def platform_core_backend_info(self) -> BackendInfo:
        return BackendInfo(
            name=self.name,
            package="tests-conformance-fixtures",
            version="0",
            api_version=self.api_version,
            available=True,
            reason="conformance fixture",
            priority=-99,
            device="cpu (fixture)",
            capabilities=self.capabilities,
        )

    @hookimpl
    def platform_core_create_backend(self, name: str, config: EngineConfig) -> Backend | None:
        if name != self.name:
            return None
        return FixtureBackend(self.name, self.capabilities, self.attention(), self.overrides)
