"""The shape of a Llama-family decoder: sizes, rope and the bias/norm switches, read from a HF
config, with the features we do not support rejected up front."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from platform_core.distributed.parallel_state import check_divisible
from platform_core.errors import ModelLoadError
from platform_core.layers.attention import HeadShards
from platform_core.layers.rotary import RopeScaling


@dataclass(frozen=True, slots=True)
class DecoderSpec:
    """Shapes and switches of one Llama-family decoder, read from a HF config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    rms_norm_eps: float
    max_position: int
    tie_embeddings: bool
    rope: RopeScaling
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def from_hf(cls, cfg: Any, **switches: bool) -> DecoderSpec:
        """Read ``cfg`` (a transformers config, 4.x or 5.x field names); ``switches`` override
        the bias/norm flags the architecture fixes. Unsupported features raise ModelLoadError."""
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"hidden_act={act!r} is not supported; supported: ('silu',)")
        max_position = int(cfg.max_position_embeddings)
        _check_sliding_window(cfg, max_position)
        rope_params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
        partial = (rope_params or {}).get(
            "partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)
        )
        if partial != 1.0:
            raise ModelLoadError(f"partial_rotary_factor={partial} is not supported")
        num_heads = int(cfg.num_attention_heads)
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        flags = {
            "qkv_bias": attention_bias,
            "o_bias": attention_bias,
            "mlp_bias": bool(getattr(cfg, "mlp_bias", False)),
            "qk_norm": False,
        }
        flags.update(switches)
        return cls(
            vocab_size=int(cfg.vocab_size),
            hidden_size=int(cfg.hidden_size),
            intermediate_size=int(cfg.intermediate_size),
            num_layers=int(cfg.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or num_heads),
            head_size=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads),
            rms_norm_eps=float(cfg.rms_norm_eps),
            max_position=max_position,
            tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            rope=RopeScaling.from_params(rope_params, getattr(cfg, "rope_theta", None)),
            **flags,
        )

    def heads_of_rank(self, rank: int, size: int) -> HeadShards:
        """The attention heads rank ``rank`` of ``size`` computes (ConfigError if unsplittable)."""
        return HeadShards.for_rank(self.num_heads, self.num_kv_heads, self.head_size, rank, size)

    def check_tensor_parallel(self, size: int) -> None:
        """ConfigError unless this decoder can be split over ``size`` tensor-parallel ranks."""
        self.heads_of_rank(0, size)
        check_divisible(self.intermediate_size, size, "intermediate_size")


def _check_sliding_window(cfg: Any, max_position: int) -> None:
    """Reject a sliding window that would mask something; one spanning the whole context is
    the same as none."""
    window = getattr(cfg, "sliding_window", None)
    if window is None or getattr(cfg, "use_sliding_window", True) is False:
        return
    if window < max_position:
        raise ModelLoadError(
            f"sliding_window={window} (< max_position_embeddings={max_position}) is not "
            "supported; only full attention is"
        )
