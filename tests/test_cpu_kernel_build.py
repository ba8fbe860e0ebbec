"""Building the compiled CPU kernels: failures reported not raised, build keys, and locks left by
a killed build."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from platform_core_cpu import kernels
from platform_core_cpu.isa import host_isa


def test_real_build_failure_is_reported_not_raised(monkeypatch, tmp_path):
    monkeypatch.setenv("PLATFORM_CORE_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "CFLAGS", ("-fno-such-flag-for-platform-core",))
    build = kernels.load_kernels.__wrapped__(
        "avx2" if "avx2" in host_isa().supported else "generic"
    )
    assert build.ops is None
    assert "no-such-flag-for-platform-core" in build.reason
    assert str(tmp_path) in str(kernels.cache_dir())


def test_build_key_tracks_sources_builder_and_level(monkeypatch, tmp_path):
    key = kernels.build_key("generic")
    assert key == kernels.build_key("generic")
    assert key != kernels.build_key("avx2")
    for name in (*kernels.SOURCES, *kernels.HEADERS):
        (tmp_path / name).write_bytes((kernels.CSRC / name).read_bytes())
    (tmp_path / "ops.cpp").write_text("// changed\n", encoding="utf-8")
    monkeypatch.setattr(kernels, "CSRC", tmp_path)
    changed_source = kernels.build_key("generic")
    assert changed_source != key
    builder = tmp_path / "kernels.py"
    builder.write_text(Path(kernels.__file__).read_text() + "# another builder\n")
    monkeypatch.setattr(kernels, "__file__", str(builder))
    assert kernels.build_key("generic") != changed_source


def test_a_stale_torch_lock_is_removed_under_our_lock(tmp_path: Path) -> None:
    (tmp_path / "lock").write_text("")
    with kernels.build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
    with kernels.build_lock(tmp_path):  # the lock is released on exit: it can be taken again
        pass


def test_a_build_killed_midway_does_not_hang_the_next_load(tmp_path: Path) -> None:
    """torch leaves ``lock`` behind when a build is killed; a later process must still load."""
    level = host_isa().level
    assert kernels.load_kernels(level).ops is not None
    name = f"platform_core_cpu_{level}_{kernels.build_key(level)}"
    built = kernels.cache_dir() / name
    shutil.copytree(built, tmp_path / "kernels" / name)
    (tmp_path / "kernels" / name / "lock").write_text("")  # what a killed build leaves
    script = (
        "from platform_core_cpu.kernels import load_kernels\n"
        f"build = load_kernels({level!r})\n"
        "assert build.ops is not None, build.reason\n"
    )
    env = {**os.environ, "PLATFORM_CORE_CACHE": str(tmp_path)}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300)
