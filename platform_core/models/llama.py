"""Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) built from a HF config on our layers.

The four architectures differ only in switches of :class:`DecoderSpec`: Qwen2 has q/k/v biases,
Qwen3 RMS-normalizes each query/key head before rotary. Module names mirror the HF checkpoint
(``model.layers.N.self_attn...``) except that q/k/v and gate/up are fused; the fused linears name
their checkpoint parts, so the loader needs no per-architecture table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from platform_core.distributed.parallel_state import TPGroup
from platform_core.layers.attention import PagedAttention
from platform_core.layers.embedding import VocabParallelEmbedding
from platform_core.layers.linear import ColumnParallelLinear, RowParallelLinear
from platform_core.layers.mlp import GatedMLP
from platform_core.layers.module import LayerModule
from platform_core.layers.norm import RMSNorm
from platform_core.layers.ops import LayerOps, resolve_ops
from platform_core.layers.rotary import RotaryEmbedding
from platform_core.models.decoder_spec import DecoderSpec

if TYPE_CHECKING:
    from collections.abc import Callable

    from platform_core.attention.metadata import AttentionMetadata
    from platform_core.plugins.interfaces import AttentionOps


@dataclass(frozen=True, slots=True)
class _Build:
    """What every module of one model is built from."""

    spec: DecoderSpec
    attention_ops: AttentionOps
    dtype: torch.dtype
    ops: LayerOps
    tp: TPGroup

    def norm(self, size: int) -> RMSNorm:
        return RMSNorm(size, self.spec.rms_norm_eps, self.dtype, self.ops.rms_norm)


class LlamaAttention(LayerModule):
    """Fused q/k/v projection, optional per-head q/k norm, rotary, paged attention, output.

    Under tensor parallelism a rank computes its own heads (``HeadShards``); the fused q/k/v
    holds its q heads, then its k heads, then its v heads, and ``o_proj`` sums over ranks.
    """

    def __init__(self, build: _Build) -> None:
        super().__init__()
        spec, dtype, tp = build.spec, build.dtype, build.tp
        heads = spec.heads_of_rank(tp.rank, tp.size)
        self._heads = (heads.num_heads, heads.num_kv_heads, spec.head_size)
        self.qkv_proj = ColumnParallelLinear(
            spec.hidden_size,
            (heads.q_rows, heads.kv_rows, heads.kv_rows),
            spec.qkv_bias,
            dtype,
            ("q_proj", "k_proj", "v_proj"),
            linear=build.ops.linear,
            quantized=build.ops.quantized_linear,
        )
        self.o_proj = RowParallelLinear(
            heads.q_rows.full,
            spec.hidden_size,
            spec.o_bias,
            dtype,
            tp,
            linear=build.ops.linear,
            quantized=build.ops.quantized_linear,
        )
        self.q_norm = build.norm(spec.head_size) if spec.qk_norm else None
        self.k_norm = build.norm(spec.head_size) if spec.qk_norm else None
        self._rotary = build.ops.rotary
        self.attn = PagedAttention(
            build.attention_ops,
            heads.num_heads,
            heads.num_kv_heads,
            spec.head_size,
            scale=spec.head_size**-0.5,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        heads, kv_heads, head_size = self._heads
        qkv = self.qkv_proj(hidden).view(hidden.shape[0], heads + 2 * kv_heads, head_size)
        q, k, v = qkv.split((heads, kv_heads, kv_heads), dim=1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rotary(q, k, cos, sin)
        return self.o_proj(self.attn(q, k, v, kv_cache, metadata))


class LlamaDecoderLayer(LayerModule):
    """Pre-norm residual block: attention then gated MLP."""

    def __init__(self, build: _Build) -> None:
        super().__init__()
        spec = build.spec
        self.input_layernorm = build.norm(spec.hidden_size)
        self.self_attn = LlamaAttention(build)
        self.post_attention_layernorm = build.norm(spec.hidden_size)
        self.mlp = GatedMLP(
            spec.hidden_size,
            spec.intermediate_size,
            spec.mlp_bias,
            build.dtype,
            build.ops.silu_and_mul,
            build.tp,
            build.ops.linear,
            build.ops.quantized_linear,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        hidden = hidden + self.self_attn(normed, cos, sin, kv_cache, metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(LayerModule):
    """Embedding, decoder layers and final norm (the checkpoint's ``model.`` prefix)."""

    def __init__(self, build: _Build) -> None:
        super().__init__()
        spec, dtype = build.spec, build.dtype
        self.embed_tokens = VocabParallelEmbedding(
            spec.vocab_size,
            spec.hidden_size,
            dtype,
            build.tp,
            build.ops.linear,
            build.ops.quantized_linear,
        )
        self.rotary_emb = RotaryEmbedding(spec.head_size, spec.max_position, spec.rope, dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(build) for _ in range(spec.num_layers))
        self.norm = build.norm(spec.hidden_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache, metadata)
        return self.norm(hidden)


class LlamaForCausalLM(LayerModule):
    """A Llama decoder with its output head; satisfies ``registry.CausalLM``.

    Build it under ``torch.device(...)``; parameters are uninitialized until the loader fills
    them. ``op_overrides`` replaces the default ops by name (see ``platform_core.layers.ops``).
    With a ``tp`` group of several ranks the model is this rank's shard: ``num_heads`` and
    ``num_kv_heads`` are the rank's own, and every ``forward`` and ``compute_logits`` call is a
    collective that all ranks of the group must make in the same order.
    """

    spec_switches: ClassVar[dict[str, bool]] = {}

    def __init__(
        self,
        hf_config: Any,
        attention_ops: AttentionOps,
        dtype: torch.dtype = torch.float32,
        op_overrides: dict[str, Callable[..., Any]] | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        tp = tp or TPGroup.single()
        spec = DecoderSpec.from_hf(hf_config, **self.spec_switches)
        spec.check_tensor_parallel(tp.size)
        heads = spec.heads_of_rank(tp.rank, tp.size)
        self.spec = spec
        self.tp = tp
        self.num_layers = spec.num_layers
        self.num_heads = heads.num_heads
        self.num_kv_heads = heads.num_kv_heads
        self.head_size = spec.head_size
        self.vocab_size = spec.vocab_size
        self.max_position = spec.max_position
        ops = resolve_ops(op_overrides)
        self.model = LlamaModel(_Build(spec, attention_ops, dtype, ops, tp))
        self.lm_head: VocabParallelEmbedding | None = None
        if not spec.tie_embeddings:
            self.lm_head = VocabParallelEmbedding(
                spec.vocab_size, spec.hidden_size, dtype, tp, ops.linear, ops.quantized_linear
            )

    @classmethod
    def check_tensor_parallel(cls, hf_config: Any, size: int) -> None:
        """ConfigError unless ``hf_config``'s model can be split over ``size`` ranks."""
        DecoderSpec.from_hf(hf_config, **cls.spec_switches).check_tensor_parallel(size)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of the flattened batch (full, on every rank); writes
        each layer's K/V of this rank's KV heads."""
        return self.model(input_ids, positions, kv_caches, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden] -> [N, vocab]`` logits of the full vocabulary in the model's dtype, on
        every rank."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return head.logits(hidden)

    def is_ignored_weight(self, name: str) -> bool:
        """Checkpoint tensors that are present in some exports but carry nothing to load."""
        if name.endswith("rotary_emb.inv_freq"):
            return True
        return self.lm_head is None and name == "lm_head.weight"


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: a Llama decoder (sliding windows are rejected by ``DecoderSpec``)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: biases on q/k/v, none on the output projection."""

    spec_switches: ClassVar[dict[str, bool]] = {"qkv_bias": True, "o_bias": False}


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: per-head RMS norm of queries and keys before rotary; head_dim from the config."""

    spec_switches: ClassVar[dict[str, bool]] = {"qk_norm": True}
