"""Read a GGUF checkpoint and materialize it once as a cached Hugging Face model directory.

A materialized directory holds ``config.json``, a float32 ``model.safetensors``, the tokenizer files
(with the chat template), ``generation_config.json`` and, written last, ``manifest.json`` listing
every file with its size and sha256. A directory whose manifest is missing, unreadable, or
disagrees with the file sizes on disk is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import gguf
from safetensors.torch import save_file

from platform_core.errors import ModelLoadError
from platform_core.models.gguf_convert import (
    gguf_config,
    gguf_state_dict,
    special_token_ids,
    write_tokenizer,
)

logger = logging.getLogger("platform_core.models")

CACHE_ENV = "PLATFORM_CORE_CACHE"
MANIFEST_NAME = "manifest.json"
_MANIFEST_FORMAT = 1
_MIB = 1 << 20


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
    _write_json(folder / "config.json", config)
    token_keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    _write_json(
        folder / "generation_config.json", {k: config[k] for k in token_keys if k in config}
    )
    if "tokenizer.ggml.model" in reader.fields:
        write_tokenizer(gguf_path, folder, special_token_ids(reader), config)
    else:
        logger.warning("%s has no tokenizer metadata; no tokenizer files written", gguf_path)
    files = {
        path.relative_to(folder).as_posix(): {"size": path.stat().st_size, "sha256": _sha256(path)}
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }
    _write_json(folder / MANIFEST_NAME, {"format": _MANIFEST_FORMAT, "files": files})


def manifest_problem(folder: Path, checksums: bool = False) -> str | None:
    """Why a materialized folder is unusable, or None when its manifest matches the files.

    Sizes are always compared (this catches truncation); ``checksums=True`` also recomputes every
    sha256, about 0.5 s for SmolLM2-135M's 540 MB of float32 weights, so the cache lookup skips it.
    """
    if not folder.is_dir():
        return "not materialized yet"
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
        files = manifest["files"] if manifest["format"] == _MANIFEST_FORMAT else None
    except FileNotFoundError:
        return "manifest is missing"
    except (OSError, ValueError, KeyError, TypeError):
        return "manifest is unreadable"
    if not isinstance(files, dict) or not files:
        return "manifest has an unknown format"
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry["size"]:
            return f"{name} has {path.stat().st_size} bytes, manifest says {entry['size']}"
        if checksums and _sha256(path) != entry["sha256"]:
            return f"{name} does not match its sha256"
    return None


def materialize_gguf(
    gguf_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """Return a cached HF model directory for a GGUF file, building it on first use.

    The cache folder is ``<cache_dir or default_cache_dir()>/gguf/<stem>-<key>``, where the key
    hashes the file's size, mtime and first and last MiB (constant cost for any file size). The
    folder is built in a temporary sibling and renamed into place, so readers never see half of it.
    """
    source = Path(gguf_path).expanduser().resolve()
    if not source.is_file():
        raise ModelLoadError(f"GGUF file {source} does not exist")
    target = Path(cache_dir or default_cache_dir()) / "gguf" / _cache_key(source)
    problem = manifest_problem(target)
    if problem is None:
        logger.info("using cached model %s for %s", target, source)
        return target
    log = logger.warning if target.exists() else logger.info
    log("materializing %s into %s (%s)", source, target, problem)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(target, "tmp")
    tmp.mkdir()  # unlike mkdtemp's 0700, honours the umask like the rest of the cache
    try:
        write_hf_model_dir(source, tmp)
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _publish(tmp: Path, target: Path) -> None:
    """Move a finished folder into place, replacing a broken one."""
    if target.exists():
        stale = _sibling(target, "stale")
        target.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp.rename(target)
    except OSError:
        # Another process published the same model between our check and now.
        if manifest_problem(target) is not None:
            raise
        logger.info("%s was materialized concurrently; using that copy", target)


def _sibling(target: Path, tag: str) -> Path:
    return target.with_name(f".{tag}-{target.name}-{uuid.uuid4().hex[:12]}")


def _cache_key(path: Path) -> str:
    stat = path.stat()
    digest = hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
    with path.open("rb") as f:
        digest.update(f.read(_MIB))
        f.seek(max(stat.st_size - _MIB, 0))
        digest.update(f.read(_MIB))
    return f"{path.stem}-{digest.hexdigest()[:16]}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(8 * _MIB):
            digest.update(chunk)
    return digest.hexdigest()


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
