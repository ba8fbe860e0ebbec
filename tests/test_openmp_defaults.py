"""OpenMP defaults are in place before torch loads, and a user's own setting wins."""

from __future__ import annotations

import os
import subprocess
import sys

from platform_core.openmp_defaults import DEFAULTS, apply_openmp_defaults

CHECK = "import platform_core, os, torch; print(os.environ['GOMP_SPINCOUNT'])"


def _child(env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if env_value is not None:
        env["GOMP_SPINCOUNT"] = env_value
    done = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_importing_platform_core_sets_the_spin_count_and_keeps_the_users():
    assert _child(None) == DEFAULTS["GOMP_SPINCOUNT"]
    assert _child("123") == "123"


def test_apply_fills_only_unset_names():
    environ = {"GOMP_SPINCOUNT": "7"}
    apply_openmp_defaults(environ)
    assert environ == {"GOMP_SPINCOUNT": "7"}
    empty: dict[str, str] = {}
    apply_openmp_defaults(empty)
    assert empty == DEFAULTS


def test_a_peer_engine_gets_the_users_environment(monkeypatch):
    import platform_core.openmp_defaults as defaults

    monkeypatch.setattr(defaults, "_filled_in_process", {"GOMP_SPINCOUNT"})
    monkeypatch.setenv("GOMP_SPINCOUNT", DEFAULTS["GOMP_SPINCOUNT"])
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    peer = defaults.environ_without_defaults()
    assert "GOMP_SPINCOUNT" not in peer and peer["OMP_NUM_THREADS"] == "2"
