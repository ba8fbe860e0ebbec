"""GGUF reading and the materialization cache on tiny seeded GGUFs: qwen2, untied heads, layout,
corruption handling and resolution of a ``.gguf`` path."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from gguf_utils import (
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    file_identity,
    transformers_gguf,
    write_tiny_gguf,
)
from safetensors.torch import load_file

from platform_core.errors import ModelLoadError
from platform_core.models.cache_manifest import MANIFEST_NAME, manifest_problem
from platform_core.models.gguf_convert import gguf_config, gguf_state_dict
from platform_core.models.gguf_loader import CACHE_ENV, materialize_gguf
from platform_core.models.resolve import resolve_model_path

LOGGER = "platform_core.models"


@pytest.mark.parametrize(("arch", "tied"), [("llama", True), ("qwen2", False)])
def test_tiny_gguf_matches_transformers(tmp_path: Path, arch: str, tied: bool) -> None:
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, tied)
    _, ref_tensors = transformers_gguf(path)
    reader = gguf.GGUFReader(path)
    config = gguf_config(reader)
    ours = gguf_state_dict(reader, config)
    assert sorted(ours) == sorted(ref_tensors)
    assert ("lm_head.weight" in ours) is not tied
    assert config["tie_word_embeddings"] is tied
    for name, ref in ref_tensors.items():
        assert torch.equal(ours[name], ref.float()), name
    assert (config["model_type"], config["num_key_value_heads"], config["head_dim"]) == (
        arch,
        KV_HEADS,
        HIDDEN // HEADS,
    )
    assert (config["rope_theta"], config["rms_norm_eps"]) == (50000.0, 1e-6)


@pytest.fixture
def tiny_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """(tiny .gguf, its materialized directory) in a fresh $PLATFORM_CORE_CACHE."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    return path, materialize_gguf(path)


def test_materialized_tiny_dir_layout(tiny_cache: tuple[Path, Path], tmp_path: Path) -> None:
    path, folder = tiny_cache
    assert folder.parent == tmp_path / "cache" / "gguf"
    assert folder.name.startswith("tiny-")
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    assert sorted(manifest["files"]) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "quantized/model.safetensors",
    ]
    # Only the published folder and its entry lock remain: no temporary or stale siblings.
    assert sorted(os.listdir(folder.parent)) == [f".{folder.name}.lock", folder.name]
    # A changed source file (new mtime) gets its own cache folder.
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert materialize_gguf(path) != folder


@pytest.mark.parametrize("damage", ["truncate_weights", "delete_manifest", "garble_manifest"])
def test_damaged_cache_is_detected_and_rebuilt(
    tiny_cache: tuple[Path, Path], damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    path, folder = tiny_cache
    weights = folder / "model.safetensors"
    good_size = weights.stat().st_size
    if damage == "truncate_weights":
        with weights.open("r+b") as f:
            f.truncate(good_size // 2)
    elif damage == "delete_manifest":
        (folder / MANIFEST_NAME).unlink()
    else:
        (folder / MANIFEST_NAME).write_text("{not json")
    assert manifest_problem(folder) is not None
    before = file_identity(weights)

    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert materialize_gguf(path) == folder
    assert "materializing" in caplog.text
    assert manifest_problem(folder, checksums=True) is None
    assert weights.stat().st_size == good_size
    assert file_identity(weights) != before
    assert len(load_file(weights)) == 2 + 9 * LAYERS


def test_checksums_catch_same_size_corruption(tiny_cache: tuple[Path, Path]) -> None:
    """A rewritten file is hashed again at the next lookup, so same-size damage is caught."""
    _, folder = tiny_cache
    weights = folder / "model.safetensors"
    with weights.open("r+b") as f:
        f.seek(-4, os.SEEK_END)
        last = f.read(4)
        f.seek(-4, os.SEEK_END)
        f.write(bytes(b ^ 0xFF for b in last))
    assert "sha256" in manifest_problem(folder)
    assert "sha256" in manifest_problem(folder, checksums=True)


def test_unsupported_architecture_is_named_and_leaves_no_debris(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "odd.gguf", arch="phi3")
    with pytest.raises(ModelLoadError, match="'phi3' is not supported"):
        materialize_gguf(path)
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir() if p.is_dir()] == []


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"definitely not gguf" * 100)
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        materialize_gguf(bogus, cache_dir=tmp_path / "cache")


def test_resolve_hf_dir_and_gguf_file(
    tiny_cache: tuple[Path, Path], tiny_model_dir: Any, tmp_path: Path
) -> None:
    path, folder = tiny_cache
    assert resolve_model_path(str(path)) == folder
    assert resolve_model_path(path) == folder
    hf_dir = tiny_model_dir("llama")
    assert resolve_model_path(str(hf_dir)) == hf_dir
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir() if p.is_dir()] == [folder.name]
