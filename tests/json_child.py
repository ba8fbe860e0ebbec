"""Test children: a test module run as a script in a fresh interpreter, reporting one JSON line.

Used where a child needs an environment the test process cannot take (``TRITON_INTERPRET=1``
must be set before Triton decorates the kernels).
"""

from __future__ import annotations

import json
import subprocess
import sys

CHILD_TIMEOUT_S = 300


def start_child(script: str, mode: str, env: dict[str, str]) -> subprocess.Popen:
    """Run ``python script mode`` with ``env``; collect it with :func:`collect`."""
    return subprocess.Popen(
        [sys.executable, script, mode],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def collect(child: subprocess.Popen, what: str) -> dict:
    """The JSON the child printed last; an assertion naming ``what`` if it failed or hung."""
    try:
        stdout, stderr = child.communicate(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise AssertionError(f"{what} child ran past {CHILD_TIMEOUT_S} s") from None
    assert child.returncode == 0, f"{what} child failed:\n{stderr[-4000:]}"
    return json.loads(stdout.strip().splitlines()[-1])
