"""Test controls over an engine that work wherever the engine runs: ``EngineProbe``.

In process mode the engine lives in an engine-core process, out of reach of a test that would
patch ``engine.engine.step``. The probe's state is a small file mapped into memory by both
processes (the probe pickles as its directory) and an append-only file of aborted ids;
``install`` runs where the engine runs (``engine_setup``) and wraps its methods to read that
state. The same probe works on an in-thread engine, so a test reads the same in both modes.
"""

from __future__ import annotations

import ctypes
import mmap
import time
from pathlib import Path
from typing import Any

from platform_core.engine.faults import FaultInjector, InjectedFault


class _State(ctypes.Structure):
    _fields_ = [
        ("delay", ctypes.c_double),
        ("once", ctypes.c_double),
        ("steps_before_failing", ctypes.c_int64),
        ("entered", ctypes.c_uint8),
        ("failing_execute", ctypes.c_uint8),
        ("integrity_wanted", ctypes.c_uint8),
        ("integrity_done", ctypes.c_uint8),
        ("failure", ctypes.c_char * 256),
        ("integrity", ctypes.c_char * 2048),
    ]


class Flag:
    """An event over one byte of the shared state (``wait`` polls)."""

    def __init__(self, state: _State, name: str) -> None:
        self._state, self._name = state, name

    def set(self) -> None:
        setattr(self._state, self._name, 1)

    def clear(self) -> None:
        setattr(self._state, self._name, 0)

    def is_set(self) -> bool:
        return bool(getattr(self._state, self._name))

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.is_set():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True


class _SharedFaults(FaultInjector):
    """Every request fails at ``execute`` while ``flag`` is set."""

    def __init__(self, flag: Flag) -> None:
        super().__init__()
        self._flag = flag

    def check(self, stage: str, request_ids: list[str]) -> None:
        if stage == "execute" and self._flag.is_set() and request_ids:
            raise InjectedFault(f"injected fault for {request_ids[0]} at {stage}")


class EngineProbe:
    """Slows, pauses or breaks steps, fails requests, records aborts, checks the KV pool.

    ``delay``: seconds added before every step. ``once``: seconds the next step stalls.
    ``entered``: set when a step starts. ``fail_after(n, message)``: the next ``n`` steps run,
    then every step raises ``RuntimeError(message)``. ``failing_execute``: while set, every
    request fails at execute (``FaultInjector``). ``aborted()``: request ids the engine was
    asked to abort. ``check_kv_integrity()``: the engine checks its block pool the next time it
    is idle and the result comes back here.
    """

    def __init__(self, directory: Path) -> None:
        state_file = directory / "probe-state"
        state_file.write_bytes(bytes(ctypes.sizeof(_State)))
        self._abort_log = directory / "aborted-request-ids"
        self._abort_log.touch()
        self._attach(directory)
        self._state.steps_before_failing = -1

    def _attach(self, directory: Path) -> None:
        self._directory = directory
        with (directory / "probe-state").open("r+b") as file:
            self._map = mmap.mmap(file.fileno(), ctypes.sizeof(_State))
        self._state = _State.from_buffer(self._map)
        self._abort_log = directory / "aborted-request-ids"
        self.entered = Flag(self._state, "entered")
        self.failing_execute = Flag(self._state, "failing_execute")
        self._integrity_wanted = Flag(self._state, "integrity_wanted")
        self._integrity_done = Flag(self._state, "integrity_done")

    def __getstate__(self) -> Path:
        return self._directory

    def __setstate__(self, directory: Path) -> None:
        self._attach(directory)

    @property
    def delay(self) -> float:
        return self._state.delay

    @delay.setter
    def delay(self, seconds: float) -> None:
        self._state.delay = seconds

    @property
    def once(self) -> float:
        return self._state.once

    @once.setter
    def once(self, seconds: float) -> None:
        self._state.once = seconds

    def fail_after(self, steps: int, message: str) -> None:
        self._state.failure = message.encode()[:255]
        self._state.steps_before_failing = steps

    def aborted(self) -> list[str]:
        return self._abort_log.read_text().split()

    def reset(self) -> None:
        """Back to plain steps, and an empty abort record."""
        self.delay = self.once = 0.0
        self._state.steps_before_failing = -1
        self.failing_execute.clear()
        self.entered.clear()
        self._abort_log.write_text("")

    def check_kv_integrity(self, timeout: float = 30.0) -> None:
        """Raise ``AssertionError`` if the engine's KV-block bookkeeping is inconsistent (the
        engine must go idle within ``timeout``: the check runs in its idle loop)."""
        self._integrity_done.clear()
        self._integrity_wanted.set()
        assert self._integrity_done.wait(timeout), "the engine did not run the integrity check"
        problem = self._state.integrity.decode()
        assert not problem, problem

    # ------------------------------------------------------------ in the engine's process
    def install(self, engine: Any) -> None:
        """Wrap ``engine``'s step, abort and idle health check (``engine_setup``)."""
        step, abort, check_health = engine.step, engine.abort_request, engine.check_health

        def probed_step() -> Any:
            self.entered.set()
            pause, self._state.once = self._state.once, 0.0
            time.sleep(pause + self._state.delay)
            left = self._state.steps_before_failing
            if left == 0:
                raise RuntimeError(self._state.failure.decode())
            if left > 0:
                self._state.steps_before_failing = left - 1
            return step()

        def recorded_abort(request_ids: list[str]) -> None:
            if request_ids:
                with self._abort_log.open("a") as log:
                    log.write("".join(f"{request_id}\n" for request_id in request_ids))
            abort(request_ids)

        def probed_check_health() -> None:
            if self._integrity_wanted.is_set():
                self._integrity_wanted.clear()
                try:
                    engine.check_kv_integrity()
                    self._state.integrity = b""
                except Exception as exc:  # reported to the test, which fails with it
                    self._state.integrity = repr(exc).encode()[:2047]
                self._integrity_done.set()
            check_health()

        engine.step = probed_step
        engine.abort_request = recorded_abort
        engine.check_health = probed_check_health
        engine.faults = _SharedFaults(self.failing_execute)
