"""Turn the user's ``model`` setting into a local Hugging Face model directory."""

from __future__ import annotations

import os
from pathlib import Path

from platform_core.errors import ModelLoadError
from platform_core.models.gguf_loader import materialize_gguf
from platform_core.models.packaged import (
    DEFAULT_MODEL,
    PACKAGED_MODELS,
    find_packaged_model,
    locate_packaged_model,
)


def resolve_model_path(model: str | os.PathLike[str] | None) -> Path:
    """Return a HF model directory (with config.json) for ``model``.

    Accepted: None (the default packaged model), a HF model directory, a path to a .gguf file
    (materialized once into the cache), or a packaged model name such as
    ``smollm2-135m-instruct``. Nothing is ever downloaded.
    """
    if model is None:
        model = DEFAULT_MODEL
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return materialize_gguf(path)
    if find_packaged_model(str(model)) is not None:
        return materialize_gguf(locate_packaged_model(str(model)))
    raise ModelLoadError(
        f"cannot resolve model {str(model)!r}: expected a Hugging Face model directory containing "
        f"config.json, a path to a .gguf file, or a packaged model name "
        f"({', '.join(sorted(PACKAGED_MODELS))}); there is no model hub access, so hub ids "
        f"cannot be downloaded"
    )
