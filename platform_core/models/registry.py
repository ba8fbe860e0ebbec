"""Maps a HF config's ``architectures[0]`` to our model class, importing it lazily.

:class:`CausalLM` is the interface every model class satisfies; the worker is written against
it, never against a concrete architecture.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol

from platform_core.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

    from platform_core.attention.metadata import AttentionMetadata

# architecture name -> (module, class); modules are imported on first use only.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("platform_core.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("platform_core.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("platform_core.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("platform_core.models.llama", "Qwen3ForCausalLM"),
}


class CausalLM(Protocol):
    """A decoder-only language model over a flattened batch and a paged KV cache.

    Constructed as ``cls(hf_config, attention_ops, dtype, op_overrides, tp)`` (see the loader),
    where ``tp`` is a :class:`~platform_core.distributed.parallel_state.TPGroup` or None.
    ``forward`` writes each layer's K/V into ``kv_caches[layer]`` through the attention ops and
    returns the final hidden states; ``compute_logits`` projects selected rows to the vocabulary.

    Under tensor parallelism the model is one rank's shard: ``num_heads`` and ``num_kv_heads``
    are this rank's (its KV cache holds only those heads), the rest are the model's. Both
    ``forward`` and ``compute_logits`` are collectives every rank must call in the same order;
    each returns the full result (hidden states, full-vocabulary logits) on every rank.
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    vocab_size: int
    max_position: int

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """``[T]`` ids and positions -> ``[T, hidden]`` hidden states."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab]`` logits in the model's dtype (float32 or narrower;
        the sampler widens what it computes with)."""

    def is_ignored_weight(self, name: str) -> bool:
        """Whether a checkpoint tensor of this name is skipped rather than reported."""

    @classmethod
    def check_tensor_parallel(cls, hf_config: Any, size: int) -> None:
        """Raise ConfigError unless ``hf_config``'s model can be split over ``size`` ranks."""


def supported_architectures() -> tuple[str, ...]:
    """HF architecture names that can be loaded."""
    return tuple(_MODELS)


def get_model_class(hf_config: Any) -> type:
    """Our class for ``hf_config.architectures[0]``; ModelLoadError lists the supported ones."""
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ModelLoadError(
            f"model config names no architecture; supported: {supported_architectures()}"
        )
    entry = _MODELS.get(architectures[0])
    if entry is None:
        raise ModelLoadError(
            f"architecture {architectures[0]!r} is not supported; "
            f"supported: {supported_architectures()}"
        )
    module_name, class_name = entry
    return getattr(importlib.import_module(module_name), class_name)


def check_tensor_parallel(hf_config: Any, size: int) -> None:
    """ConfigError unless ``hf_config``'s model splits over ``size`` tensor-parallel ranks
    (head counts, intermediate size); cheap, builds nothing, so callers check before spawning."""
    get_model_class(hf_config).check_tensor_parallel(hf_config, size)
