"""Start-up after interrupted or damaged earlier starts: the GGUF model cache (writers killed
mid-materialization, concurrent starts, content verification once per file change) and the
compiled CPU kernels (builds killed by SIGTERM or SIGKILL, damaged libraries)."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from gguf_utils import write_tiny_gguf
from platform_core_cpu import kernels
from platform_core_cpu.isa import host_isa
from safetensors.torch import load_file

from platform_core.errors import ModelLoadError
from platform_core.models import cache_manifest
from platform_core.models.cache_manifest import STAMP_NAME, manifest_problem
from platform_core.models.gguf_loader import CACHE_ENV, materialize_gguf

LOGGER = "platform_core.models"

# Materializes argv[1] for real, then stalls before publishing it, holding the entry lock: a
# writer caught mid-materialization, to be killed or left running.
_STALLED_WRITER = """
import sys, time
from platform_core.models import gguf_loader
real = gguf_loader.write_hf_model_dir
def write_then_stall(source, folder):
    real(source, folder)
    print(folder, flush=True)
    time.sleep(300)
gguf_loader.write_hf_model_dir = write_then_stall
gguf_loader.materialize_gguf(sys.argv[1])
"""


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh $PLATFORM_CORE_CACHE (also inherited by subprocesses)."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def writers() -> Iterator[list[subprocess.Popen[str]]]:
    """Subprocesses started by a test; any still running at its end are killed."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait(timeout=30)


def _stalled_writer(gguf_path: Path, writers: list[subprocess.Popen[str]]) -> Path:
    """Start a writer of ``gguf_path`` that stalls mid-materialization; its scratch folder."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _STALLED_WRITER, str(gguf_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    writers.append(proc)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    line = proc.stdout.readline().strip() if ready else ""
    assert line, f"the writer did not get to its scratch folder: {proc.poll()=}"
    scratch = Path(line)
    assert scratch.name.startswith(".tmp-") and (scratch / "model.safetensors").is_file()
    return scratch


def test_a_killed_writers_scratch_is_removed_and_a_live_ones_kept(
    cache: Path,
    tmp_path: Path,
    writers: list[subprocess.Popen[str]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    a = write_tiny_gguf(tmp_path / "a.gguf", seed=0)
    b = write_tiny_gguf(tmp_path / "b.gguf", seed=1)
    live = _stalled_writer(b, writers)
    killed = _stalled_writer(a, writers)
    writers[1].send_signal(signal.SIGKILL)
    writers[1].wait(timeout=30)

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        folder = materialize_gguf(a)
    assert not killed.exists()
    assert f"removing {killed}" in caplog.text
    assert live.is_dir() and (live / "model.safetensors").is_file()
    assert manifest_problem(folder, checksums=True) is None

    writers[0].send_signal(signal.SIGKILL)
    writers[0].wait(timeout=30)
    assert materialize_gguf(a) == folder  # a cache hit still clears b's abandoned scratch
    assert not live.exists()
    assert sorted(p.name for p in cache.joinpath("gguf").iterdir() if p.is_dir()) == [folder.name]


def test_a_concurrent_start_waits_for_the_live_writer_instead_of_racing_it(
    cache: Path,
    tmp_path: Path,
    writers: list[subprocess.Popen[str]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    path = write_tiny_gguf(tmp_path / "a.gguf")
    scratch = _stalled_writer(path, writers)
    result: list[Path] = []
    with caplog.at_level(logging.INFO, logger=LOGGER):
        waiter = threading.Thread(target=lambda: result.append(materialize_gguf(path)))
        waiter.start()
        waiter.join(timeout=1.0)
        assert waiter.is_alive() and scratch.is_dir()  # waits; the writer's work is untouched
        writers[0].send_signal(signal.SIGKILL)
        waiter.join(timeout=60)
    assert not waiter.is_alive() and result
    assert "waiting for another process" in caplog.text
    assert not scratch.exists()
    assert manifest_problem(result[0], checksums=True) is None


def _flip_middle_bytes(path: Path, keep_mtime: bool) -> None:
    info = path.stat()
    with path.open("r+b") as f:
        f.seek(info.st_size // 2)
        data = f.read(16)
        f.seek(info.st_size // 2)
        f.write(bytes(b ^ 0x5A for b in data))
    if keep_mtime:
        os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))
    assert path.stat().st_size == info.st_size


@pytest.mark.parametrize("keep_mtime", [False, True], ids=["mtime_changed", "mtime_restored"])
def test_same_size_corruption_is_detected_and_rebuilt(
    cache: Path, tmp_path: Path, keep_mtime: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Any write moves the file's ctime, which os.utime cannot restore, so it is hashed again."""
    path = write_tiny_gguf(tmp_path / "a.gguf")
    folder = materialize_gguf(path)
    weights = folder / "model.safetensors"
    good = {name: tensor.clone() for name, tensor in load_file(weights).items()}  # not the mmap
    _flip_middle_bytes(weights, keep_mtime)
    assert any(not torch.equal(good[k], v) for k, v in load_file(weights).items())

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert materialize_gguf(path) == folder
    assert "model.safetensors does not match its sha256" in caplog.text
    assert manifest_problem(folder, checksums=True) is None
    rebuilt = load_file(weights)
    assert all(torch.equal(good[k], rebuilt[k]) for k in good)


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the files the manifest check hashes, in order."""
    names: list[str] = []
    real = cache_manifest._sha256

    def counting(path: Path) -> str:
        names.append(path.name)
        return real(path)

    monkeypatch.setattr(cache_manifest, "_sha256", counting)
    return names


def test_content_is_hashed_once_per_file_change(
    cache: Path, tmp_path: Path, hashed: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    path = write_tiny_gguf(tmp_path / "a.gguf")
    folder = materialize_gguf(path)
    weights = folder / "model.safetensors"
    inode = weights.stat().st_ino
    # model.safetensors twice: the dequantized weights and quantized/ (the blocks as stored)
    assert sorted(hashed) == ["config.json", "generation_config.json"] + ["model.safetensors"] * 2

    hashed.clear()
    assert materialize_gguf(path) == folder
    assert hashed == []  # the build's hashes were recorded: a cache hit only stats

    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert materialize_gguf(path) == folder
    assert hashed == ["model.safetensors"]  # touched, same content: hashed, trusted, kept
    assert "using cached model" in caplog.text and "materializing" not in caplog.text
    assert weights.stat().st_ino == inode

    hashed.clear()
    materialize_gguf(path)
    assert hashed == []

    (folder / STAMP_NAME).unlink()  # a cache written before stamps existed
    materialize_gguf(path)
    assert len(hashed) == 4 and weights.stat().st_ino == inode
    hashed.clear()
    materialize_gguf(path)
    assert hashed == []


def test_a_cache_whose_stamp_and_lock_cannot_be_written_is_still_used(
    cache: Path, tmp_path: Path, hashed: list[str]
) -> None:
    """As in a read-only cache: served unlocked, hashed on every lookup."""
    path = write_tiny_gguf(tmp_path / "a.gguf")
    folder = materialize_gguf(path)
    for name in (folder / STAMP_NAME, folder.with_name(f".{folder.name}.lock")):
        name.unlink()
        name.mkdir()  # cannot be opened or replaced as a file
    for _ in range(2):
        hashed.clear()
        assert materialize_gguf(path) == folder
        assert len(hashed) == 4
    assert not [p for p in folder.iterdir() if p.name.startswith(f".{STAMP_NAME}")]


def test_an_unusable_cache_folder_is_a_clear_error(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "a.gguf")
    not_a_folder = tmp_path / "cache"
    not_a_folder.write_text("")
    with pytest.raises(ModelLoadError, match=f"cannot materialize a.gguf .*{CACHE_ENV}"):
        materialize_gguf(path, cache_dir=not_a_folder)


# What a start does with the kernels, checked by running one of the compiled ops.
_LOAD_KERNELS = """
import sys, torch
from platform_core_cpu.kernels import load_kernels
build = load_kernels(sys.argv[1])
assert build.ops is not None, build.reason
x = torch.randn(8, 300)
assert torch.equal(build.ops.argmax_rows(x).long(), x.argmax(-1)), "wrong argmax"
"""
_BUILD_S = 600  # a full compile takes 1-2 min on 2 busy cores


def _kernel_build(cache_root: Path) -> tuple[str, Path]:
    """(host ISA level, its build folder under ``cache_root``)."""
    level = host_isa().level
    return level, cache_root / "kernels" / f"platform_core_cpu_{level}_{kernels.build_key(level)}"


def _start(level: str, cache_root: Path) -> subprocess.Popen[str]:
    """A start that loads the kernels, in its own process group (as a service manager runs it)."""
    return subprocess.Popen(
        [sys.executable, "-c", _LOAD_KERNELS, level],
        env={**os.environ, CACHE_ENV: str(cache_root)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = _BUILD_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_compiles_killed_by_sigterm_and_sigkill_do_not_wedge_the_next_start(
    tmp_path: Path,
) -> None:
    """A real compile is killed twice (its whole process group: Python, ninja and the compilers),
    each time leaving torch's lock file, which used to hang every later start; the third start
    discards the half-written build, compiles and loads."""
    level, build_dir = _kernel_build(tmp_path)
    torch_lock = build_dir / "lock"
    delay = random.uniform(0.0, 2.0)
    began = time.time()

    def an_object_written_by_this_start() -> bool:
        return any(p.stat().st_mtime >= began for p in build_dir.glob("*.o"))

    kill_points: list[tuple[signal.Signals, Callable[[], bool], str]] = [
        (signal.SIGTERM, torch_lock.exists, f"torch's lock, then {delay:.2f} s"),
        (signal.SIGKILL, an_object_written_by_this_start, "the first object file"),
    ]
    for sig, ready, what in kill_points:
        began = time.time()
        proc = _start(level, tmp_path)
        try:
            _wait_for(lambda ready=ready, proc=proc: ready() or proc.poll() is not None, what)
            if sig == signal.SIGTERM:
                time.sleep(delay)
            assert proc.poll() is None, f"the start ended before {what}: {proc.communicate()[0]}"
            os.killpg(proc.pid, sig)
            proc.wait(timeout=30)
            _wait_for(lambda proc=proc: not _group_alive(proc.pid), "the build to stop", 10)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        assert torch_lock.exists(), f"{sig.name} at {what} left no lock to break"

    last = _start(level, tmp_path)
    output, _ = last.communicate(timeout=_BUILD_S)
    assert last.returncode == 0, output
    assert "removing a stale build lock" in output, output
    assert "discarded the build" in output, output
    assert not torch_lock.exists()
    assert kernels.build_problem(build_dir, build_dir / f"{build_dir.name}.so") is None


def test_a_damaged_library_is_rebuilt_not_given_up_on(tmp_path: Path) -> None:
    """A truncated .so used to be loaded as it was (ninja sees it newer than its objects), which
    crashed every later start with SIGBUS; it is now discarded and rebuilt."""
    level, built = _kernel_build(kernels.cache_dir().parent)
    assert kernels.load_kernels(level).ops is not None
    _, build_dir = _kernel_build(tmp_path)
    shutil.copytree(built, build_dir)
    library = build_dir / f"{build_dir.name}.so"
    good_size = library.stat().st_size
    with library.open("r+b") as f:
        f.truncate(good_size // 2)
    assert "changed since it last loaded" in kernels.build_problem(build_dir, library)

    result = _start(level, tmp_path)
    output, _ = result.communicate(timeout=_BUILD_S)
    assert result.returncode == 0, output
    assert "discarded the build" in output
    assert library.stat().st_size == good_size
    assert kernels.build_problem(build_dir, library) is None
