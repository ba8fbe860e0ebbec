"""Reading the non-weight files of a HF model directory: config, tokenizer, generation config.

Everything is read from local files only (no hub access exists at run time) and remote code is
never executed unless ``trust_remote_code`` is set explicitly.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from platform_core.errors import ModelLoadError

logger = logging.getLogger("platform_core.models")

# generation_config.json keys that become SamplingParams defaults, and their SamplingParams names.
_GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def load_hf_config(model_dir: Path, trust_remote_code: bool = False) -> Any:
    """The model's ``PretrainedConfig`` from ``config.json``."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(
            model_dir, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot read the model config in {model_dir}: {exc}") from exc


def load_tokenizer(path: str | Path) -> Any:
    """The fast tokenizer in ``path``, or ``None`` (with a warning) when there is none."""
    from transformers import AutoTokenizer

    try:
        # Llama-family tokenizers are byte-level BPE: the WordPiece-era "clean up spaces" pass
        # would strip spaces before punctuation, so it is always off.
        return AutoTokenizer.from_pretrained(
            path, local_files_only=True, clean_up_tokenization_spaces=False
        )
    except (OSError, ValueError, TypeError) as exc:
        logger.warning("no tokenizer found in %s; only token-id prompts will work", path)
        logger.debug("tokenizer load error: %s", exc)
        return None


def load_generation_config(model_dir: Path) -> Any:
    """The model's ``GenerationConfig``, or ``None`` when the directory has none."""
    from transformers import GenerationConfig

    if not (Path(model_dir) / "generation_config.json").exists():
        return None
    try:
        return GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        logger.warning("ignoring unreadable generation_config.json in %s: %s", model_dir, exc)
        return None


def generation_defaults(generation_config: Any) -> dict[str, Any]:
    """Sampling defaults the model's authors recommend, as SamplingParams field names.

    Only values the file sets explicitly count (not transformers' class defaults).
    """
    if generation_config is None:
        return {}
    explicit = generation_config.to_diff_dict()
    defaults = {
        ours: explicit[theirs] for theirs, ours in _GENERATION_KEYS.items() if theirs in explicit
    }
    if explicit.get("do_sample") is False:
        defaults["temperature"] = 0.0
    return defaults
