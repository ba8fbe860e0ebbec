"""Read a GGUF checkpoint and materialize it once as a cached Hugging Face model directory.

A materialized directory holds ``config.json``, a float32 ``model.safetensors``, the quantized
tensors' blocks as stored (``quantized/model.safetensors``, :mod:`.quantized_checkpoint`), the
tokenizer files (with the chat template), ``generation_config.json`` and, written last,
``manifest.json`` listing
every file with its size and sha256. A directory whose manifest is missing, unreadable, or
disagrees with the files on disk (sizes, and sha256s once per file change) is rebuilt.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import gguf
from safetensors.torch import save_file

from platform_core.errors import ModelLoadError
from platform_core.models.cache_entry import entry_lock, scratch_sibling
from platform_core.models.cache_manifest import manifest_problem, write_json, write_manifest
from platform_core.models.gguf_convert import (
    gguf_config,
    gguf_quantized_tensors,
    gguf_state_dict,
    special_token_ids,
    write_tokenizer,
)
from platform_core.models.quantized_checkpoint import write_quantized_tensors

logger = logging.getLogger("platform_core.models")

CACHE_ENV = "PLATFORM_CORE_CACHE"
_MIB = 1 << 20
# Part of the cache key: a folder written by an older layout (without quantized/) is not reused.
_LAYOUT = 2


def default_cache_dir() -> Path:
    """``$PLATFORM_CORE_CACHE``, or ``~/.cache/platform-core`` when it is unset."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "platform-core")


def write_hf_model_dir(gguf_path: Path, folder: Path) -> None:
    """Write config, float32 safetensors, tokenizer, generation config and manifest into folder."""
    try:
        reader = gguf.GGUFReader(gguf_path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {gguf_path}: {exc}") from exc
    config = gguf_config(reader)
    save_file(gguf_state_dict(reader, config), folder / "model.safetensors", {"format": "pt"})
    quantized = gguf_quantized_tensors(reader, config)
    if quantized:
        write_quantized_tensors(folder, quantized)
    write_json(folder / "config.json", config)
    token_keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    write_json(folder / "generation_config.json", {k: config[k] for k in token_keys if k in config})
    if "tokenizer.ggml.model" in reader.fields:
        write_tokenizer(gguf_path, folder, special_token_ids(reader), config)
    else:
        logger.warning("%s has no tokenizer metadata; no tokenizer files written", gguf_path)
    write_manifest(folder)


def materialize_gguf(
    gguf_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """Return a cached HF model directory for a GGUF file, building it on first use.

    The cache folder is ``<cache_dir or default_cache_dir()>/gguf/<stem>-<key>``, where the key
    hashes the file's size, mtime and first and last MiB (constant cost for any file size). It is
    checked against its manifest by content (:mod:`.cache_manifest`) and rebuilt when damaged.
    It is built in a temporary sibling and renamed into place, so readers never see half of it,
    under a lock that also clears what an interrupted earlier build left (:mod:`.cache_entry`).
    """
    source = Path(gguf_path).expanduser().resolve()
    if not source.is_file():
        raise ModelLoadError(f"GGUF file {source} does not exist")
    target = Path(cache_dir or default_cache_dir()) / "gguf" / _cache_key(source)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with entry_lock(target):
            problem = manifest_problem(target)
            if problem is None:
                logger.info("using cached model %s for %s", target, source)
                return target
            log = logger.warning if target.exists() else logger.info
            log("materializing %s into %s (%s)", source, target, problem)
            with scratch_sibling(target, "tmp") as tmp:
                tmp.mkdir()  # unlike mkdtemp's 0700, honours the umask like the rest of the cache
                write_hf_model_dir(source, tmp)
                with scratch_sibling(target, "stale") as stale:
                    if target.exists():
                        target.rename(stale)
                    tmp.rename(target)
    except OSError as exc:
        raise ModelLoadError(
            f"cannot materialize {source.name} into {target.parent}: {exc} (set {CACHE_ENV} "
            f"to a writable folder with room for the float32 weights)"
        ) from exc
    return target


def _cache_key(path: Path) -> str:
    stat = path.stat()
    digest = hashlib.sha256(f"{_LAYOUT}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    with path.open("rb") as f:
        digest.update(f.read(_MIB))
        f.seek(max(stat.st_size - _MIB, 0))
        digest.update(f.read(_MIB))
    return f"{path.stem}-{digest.hexdigest()[:16]}"
