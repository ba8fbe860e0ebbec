"""The manifest of a materialized model folder, and checking the folder's files against it.

``manifest.json`` lists every file with its size and sha256. Hashing SmolLM2-135M's 538 MB of
float32 weights takes 0.4 s from the page cache and about 1.4 s from disk, so each file is hashed
once per change: ``verified.json`` beside the manifest records, per file, the stat (size, mtime,
ctime, inode) under which its sha256 last matched. A file whose stat still equals that record is
trusted; any write to it moves its ctime (which ``os.utime`` cannot set back), so it is hashed
again. A corruption that leaves the stat untouched (bit rot below the file system) is trusted by
design.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger("platform_core.models")

MANIFEST_NAME = "manifest.json"
STAMP_NAME = "verified.json"
_FORMAT = 1
_CHUNK = 8 << 20


def write_manifest(folder: Path) -> None:
    """Hash every file in ``folder`` into its manifest, and record them as verified."""
    files = {
        path.relative_to(folder).as_posix(): {"size": path.stat().st_size, "sha256": _sha256(path)}
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }
    write_json(folder / MANIFEST_NAME, {"format": _FORMAT, "files": files})
    _write_stamp(folder, {name: _stamp(folder / name, e["sha256"]) for name, e in files.items()})


def manifest_problem(folder: Path, checksums: bool = False) -> str | None:
    """Why a materialized folder is unusable, or None when its files match the manifest.

    Sizes are always compared and sha256s are checked for every file changed since its last
    verification (see the module docstring); ``checksums=True`` hashes every file regardless.
    """
    if not folder.is_dir():
        return "not materialized yet"
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
        files = manifest["files"] if manifest["format"] == _FORMAT else None
    except FileNotFoundError:
        return "manifest is missing"
    except (OSError, ValueError, KeyError, TypeError):
        return "manifest is unreadable"
    if not isinstance(files, dict) or not files:
        return "manifest has an unknown format"
    verified = {} if checksums else _read_stamp(folder)
    stamps = {}
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry["size"]:
            return f"{name} has {path.stat().st_size} bytes, manifest says {entry['size']}"
        stamps[name] = _stamp(path, entry["sha256"])
        if verified.get(name) != stamps[name] and _sha256(path) != entry["sha256"]:
            return f"{name} does not match its sha256: its content changed since it was written"
    if stamps != verified:
        _write_stamp(folder, stamps)
    return None


def _stamp(path: Path, sha256: str) -> dict[str, Any]:
    info = path.stat()
    return {
        "size": info.st_size,
        "mtime_ns": info.st_mtime_ns,
        "ctime_ns": info.st_ctime_ns,
        "inode": info.st_ino,
        "sha256": sha256,
    }


def _read_stamp(folder: Path) -> dict[str, Any]:
    try:
        stamp = json.loads((folder / STAMP_NAME).read_text())
        files = stamp["files"] if stamp["format"] == _FORMAT else {}
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return files if isinstance(files, dict) else {}


def _write_stamp(folder: Path, files: dict[str, Any]) -> None:
    """Replace the stamp atomically; a cache that cannot be written (read-only) is hashed on
    every lookup instead."""
    partial = folder / f".{STAMP_NAME}.{os.getpid()}"
    try:
        write_json(partial, {"format": _FORMAT, "files": files})
        partial.replace(folder / STAMP_NAME)
    except OSError as exc:
        logger.debug("cannot record verified hashes in %s: %s", folder, exc)
        partial.unlink(missing_ok=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as indented, key-sorted JSON."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
