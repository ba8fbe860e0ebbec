"""Time the first materialization of a GGUF model against a later load from the cache.

Usage: ``python benchmarks/gguf_cache_load.py [MODEL]`` where MODEL is a .gguf path or a packaged
model name (default: the packaged SmolLM2). The cache is a fresh temporary directory. "Cached load"
is what a later start-up pays: resolve the model (cache key + manifest size check), parse
config.json and load the float32 safetensors (lazily mapped, then with every byte read).
transformers is imported before timing, so the first run is charged for conversion work only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import transformers  # noqa: F401  (imported up front; see the docstring)
from safetensors.torch import load_file

from platform_core.models.cache_manifest import manifest_problem
from platform_core.models.gguf_loader import CACHE_ENV
from platform_core.models.packaged import DEFAULT_MODEL, find_packaged_model, locate_packaged_model
from platform_core.models.resolve import resolve_model_path


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds taken by ``fn()`` and its result."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def cached_load(gguf_path: Path, read_all: bool) -> int:
    """Resolve from the cache and load weights + config; returns the parameter count.

    ``load_file`` maps the file lazily; ``read_all`` clones every tensor, which reads every byte
    into private memory as a real weight load (a copy onto the device) would.
    """
    folder = resolve_model_path(gguf_path)
    json.loads((folder / "config.json").read_text())
    weights = load_file(folder / "model.safetensors")
    if read_all:
        weights = {name: tensor.clone() for name, tensor in weights.items()}
    return sum(t.numel() for t in weights.values())


def sha256_file(path: Path) -> str:
    """Full sha256 of a file (the alternative cache key we measure against)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def main() -> None:
    """Run the comparison and print the numbers."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    parser.add_argument("--repeats", type=int, default=3, help="cached loads to take the best of")
    args = parser.parse_args()
    is_packaged = find_packaged_model(args.model) is not None
    gguf_path = locate_packaged_model(args.model) if is_packaged else Path(args.model)

    with tempfile.TemporaryDirectory() as cache:
        os.environ[CACHE_ENV] = cache
        first_s, folder = timed(lambda: resolve_model_path(gguf_path))
        resolve_s = min(timed(lambda: resolve_model_path(gguf_path))[0] for _ in range(5))
        lazy_s, params = min(
            timed(lambda: cached_load(gguf_path, False)) for _ in range(args.repeats)
        )
        read_s = min(timed(lambda: cached_load(gguf_path, True))[0] for _ in range(args.repeats))
        checksum_s = timed(lambda: manifest_problem(folder, checksums=True))[0]
        weights_mb = (folder / "model.safetensors").stat().st_size / 1e6
    full_hash_s = timed(lambda: sha256_file(gguf_path))[0]

    gguf_mb = gguf_path.stat().st_size / 1e6
    print(f"model: {gguf_path.name} ({gguf_mb:.0f} MB GGUF, {params / 1e6:.1f} M params)")
    print(f"first materialization:        {first_s:8.2f} s  ({weights_mb:.0f} MB float32 written)")
    print(f"cached resolve only:          {resolve_s * 1e3:8.2f} ms")
    print(f"cached resolve + load_file:   {lazy_s:8.2f} s  (mmap, lazy)")
    print(f"  ... + read every byte:      {read_s:8.2f} s")
    print(f"ratio first / cached (lazy):  {first_s / lazy_s:8.1f} x")
    print(f"ratio first / cached (read):  {first_s / read_s:8.1f} x")
    print(f"manifest sha256 verification: {checksum_s:8.2f} s  (cached path: once per file change)")
    print(f"full sha256 of the GGUF:      {full_hash_s:8.2f} s  (key uses size+mtime+1st/last MiB)")


if __name__ == "__main__":
    main()
