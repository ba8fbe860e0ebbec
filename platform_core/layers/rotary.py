"""Rotary position embedding (half-split "neox" layout) with a precomputed cos/sin cache.

The cache holds ``[cos | sin]`` for every position up to ``max_position`` in the model's dtype
(computed in float32 first, as the reference does), so a forward step only gathers rows for its
positions once and every layer reuses them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from platform_core.errors import ModelLoadError
from platform_core.layers.module import LayerModule

RotaryFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
]
"""``rotary(query, key, cos, sin) -> (query, key)``: ``query`` ``[T, H, D]``, ``key``
``[T, H_kv, D]`` (possibly strided views of the fused q/k/v output), ``cos``/``sin``
``[T, D // 2]``. Rotates pairs ``(i, i + D/2)``; may work in place and must return the rotated
tensors."""

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def apply_rotary(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Default rotary op: returns new rotated ``query`` and ``key``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        first, second = x.chunk(2, dim=-1)
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)

    return rotate(query), rotate(key)


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE base and frequency scaling; ``rope_type`` is one of ``SUPPORTED_ROPE_TYPES``."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(
                f"rope scaling type {self.rope_type!r} is not supported; "
                f"supported: {SUPPORTED_ROPE_TYPES}"
            )

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None, theta: float | None) -> RopeScaling:
        """Read HF ``rope_parameters`` / ``rope_scaling`` (either spelling of the type key).

        ``theta`` is the config's top-level ``rope_theta`` (older configs); a ``rope_theta``
        inside ``params`` (transformers 5) takes precedence.
        """
        params = dict(params or {})
        rope_type = params.get("rope_type") or params.get("type") or "default"
        base = params.get("rope_theta", theta)
        kwargs: dict[str, Any] = {
            "theta": float(base if base is not None else 10000.0),
            "rope_type": rope_type,
        }
        if rope_type in ("linear", "llama3"):
            kwargs["factor"] = float(params["factor"])
        if rope_type == "llama3":
            kwargs["low_freq_factor"] = float(params["low_freq_factor"])
            kwargs["high_freq_factor"] = float(params["high_freq_factor"])
            kwargs["original_max_position"] = int(params["original_max_position_embeddings"])
        return cls(**kwargs)

    def inverse_frequencies(self, head_size: int) -> torch.Tensor:
        """Float32 ``[head_size // 2]`` rotation frequencies after scaling."""
        exponents = torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size
        inv_freq = 1.0 / (self.theta**exponents)
        if self.rope_type == "linear":
            return inv_freq / self.factor
        if self.rope_type == "llama3":
            return self._llama3_frequencies(inv_freq)
        return inv_freq

    def _llama3_frequencies(self, inv_freq: torch.Tensor) -> torch.Tensor:
        # Short wavelengths stay, long ones are divided by `factor`, and the band between the
        # two thresholds blends both linearly in (context / wavelength).
        wavelength = 2 * math.pi / inv_freq
        short_limit = self.original_max_position / self.high_freq_factor
        long_limit = self.original_max_position / self.low_freq_factor
        scaled = inv_freq / self.factor
        blend = (self.original_max_position / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        mixed = (1 - blend) * scaled + blend * inv_freq
        return torch.where(
            wavelength < short_limit,
            inv_freq,
            torch.where(wavelength > long_limit, scaled, mixed),
        )


class RotaryEmbedding(LayerModule):
    """Owns the ``[max_position, head_size]`` cos/sin cache and gathers it by position."""

    def __init__(
        self, head_size: int, max_position: int, scaling: RopeScaling, dtype: torch.dtype
    ) -> None:
        super().__init__()
        if head_size % 2:
            raise ModelLoadError(f"rotary embedding needs an even head size, got {head_size}")
        inv_freq = scaling.inverse_frequencies(head_size)
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        cache = torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype)
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self.max_position = max_position

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` ``[T, head_size // 2]`` for ``positions`` ``[T]``."""
        rows = self.cos_sin_cache.index_select(0, positions)
        cos, sin = rows.chunk(2, dim=-1)
        return cos, sin
