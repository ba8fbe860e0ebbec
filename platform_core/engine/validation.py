"""Admission checks of a request against the model and engine limits (typed 400-class errors)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from platform_core.errors import InvalidRequestError
from platform_core.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What the engine can accept: context, vocabulary, samples per request, tokenizer."""

    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    has_tokenizer: bool


def validate_request(
    prompt_token_ids: list[int], params: SamplingParams, limits: RequestLimits
) -> None:
    """Raise ``InvalidRequestError`` (naming the parameter) if the request cannot run."""
    if not prompt_token_ids:
        raise InvalidRequestError("the prompt is empty", "prompt")
    if len(prompt_token_ids) >= limits.max_model_len:
        raise InvalidRequestError(
            f"the prompt has {len(prompt_token_ids)} tokens, but this model's context is "
            f"{limits.max_model_len} tokens (at least one must be left to generate)",
            "prompt",
        )
    vocab = limits.vocab_size
    bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
    if bad:
        raise InvalidRequestError(
            f"prompt token ids must be in [0, {vocab}); got {bad[:5]}", "prompt"
        )
    params.validate_token_ids(vocab)
    if params.n > limits.max_num_seqs:
        raise InvalidRequestError(
            f"n must be <= max_num_seqs ({limits.max_num_seqs}), got {params.n}", "n"
        )
    if params.stop and not limits.has_tokenizer:
        raise InvalidRequestError("stop strings need a tokenizer; this model has none", "stop")


def check_kv_transfer_params(
    params: dict[str, Any] | None, has_connector: bool
) -> dict[str, Any] | None:
    """``params`` if this engine can take them: a JSON object, and a KV connector to read it."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise InvalidRequestError(
            f"kv_transfer_params must be an object, got {type(params).__name__}",
            "kv_transfer_params",
        )
    if not has_connector:
        raise InvalidRequestError(
            "kv_transfer_params were given, but this instance runs no KV connector (start it "
            "with --kv-transfer-config)",
            "kv_transfer_params",
        )
    return params
