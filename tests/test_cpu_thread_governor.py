"""The CPU backend's thread governor (issue #28, contention): steps run on the cores other
processes leave free, measured from ``/proc``, with two agreeing windows and a band against
flapping; the model runner calls it before every step."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
from platform_core_cpu import plugin
from platform_core_cpu.isa import host_isa
from platform_core_cpu.thread_governor import (
    ADAPTIVE_THREADS_ENV,
    ForeignLoadMeter,
    ThreadGovernor,
    governor_enabled,
)

from platform_core import LLM, SamplingParams


class ScriptedMeter:
    """Reports the foreign loads it was given, one per window, then ``then``, on ``cores``
    cores."""

    def __init__(self, loads: list[float], cores: int = 4, then: float = 0.0) -> None:
        self.loads = list(loads)
        self.cores = cores
        self.then = then
        self.samples = 0

    def sample(self) -> float:
        self.samples += 1
        return self.loads.pop(0) if self.loads else self.then


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run_windows(loads: list[float], cores: int = 4, base: int = 4) -> tuple[list[int], list[int]]:
    """The thread counts set, and the count after each window."""
    applied: list[int] = []
    clock = Clock()
    governor = ThreadGovernor(
        ScriptedMeter(loads, cores), base, window_s=1.0, set_threads=applied.append, clock=clock
    )
    governor.before_step()  # the first call only starts the first window
    after = []
    for _ in loads:
        clock.now += 1.0
        governor.before_step()
        after.append(governor.threads)
    return applied, after


def test_a_taken_core_costs_a_thread_once_two_windows_agree():
    applied, after = _run_windows([0.0, 1.0, 1.0, 1.0])
    assert after == [4, 4, 3, 3] and applied == [3]


def test_one_busy_window_changes_nothing():
    applied, after = _run_windows([1.3, 0.0, 2.1, 0.1, 0.0])
    assert applied == [] and after == [4] * 5


def test_the_band_keeps_a_half_busy_neighbour_from_flapping_and_a_freed_core_comes_back():
    applied, after = _run_windows([0.9, 0.9, 0.5, 0.45, 0.55, 0.5, 0.2, 0.1])
    assert applied == [3, 4]
    assert after == [4, 3, 3, 3, 3, 3, 3, 4]


def test_threads_stay_between_one_and_the_base():
    applied, after = _run_windows([3.8, 3.9, 0.0, 0.0], cores=4, base=2)
    assert applied == [1, 2] and after == [2, 1, 1, 2]


def test_measures_at_most_once_a_window():
    meter = ScriptedMeter([2.0, 2.0])
    clock = Clock()
    governor = ThreadGovernor(meter, 4, window_s=1.0, set_threads=lambda n: None, clock=clock)
    for _ in range(50):
        governor.before_step()
        clock.now += 0.01
    assert meter.samples == 0  # half a window: only the first call ran, and it measures nothing
    clock.now += 1.0
    governor.before_step()
    assert meter.samples == 1


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_the_meter_counts_another_process_but_not_our_own_threads():
    meter = ForeignLoadMeter()
    before = meter.read()
    _spin(1.0)  # ours: one core's worth that must not count as foreign
    assert meter.read().own_s - before.own_s > 0.6
    assert meter.sample() < 0.5
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # the child's interpreter starts
        meter.sample()
        time.sleep(1.0)
        assert meter.sample() > 0.6
    finally:
        busy.kill()
        busy.wait()


def test_the_environment_turns_the_governor_off(monkeypatch):
    monkeypatch.setenv(ADAPTIVE_THREADS_ENV, "0")
    assert not governor_enabled()
    assert plugin.CpuBackend()._threads is None
    assert any("step threads: fixed" in line for line in plugin.describe_paths(host_isa()))
    monkeypatch.delenv(ADAPTIVE_THREADS_ENV)
    assert governor_enabled()
    assert any("other processes" in line for line in plugin.describe_paths(host_isa()))


@pytest.fixture
def torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_the_model_runner_consults_the_governor_before_each_step(
    tiny_model_dir, monkeypatch, torch_threads
):
    """A neighbour that takes one of two cores: the engine's steps drop to one thread."""
    applied: list[int] = []

    def governed() -> ThreadGovernor:
        return ThreadGovernor(
            ScriptedMeter([], cores=2, then=1.0), 2, window_s=0.0, set_threads=applied.append
        )

    monkeypatch.setattr(plugin, "ThreadGovernor", governed)
    llm = LLM(str(tiny_model_dir("llama")), backend="cpu", dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert (
        len(
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)[0]
            .outputs[0]
            .token_ids
        )
        == 4
    )
    assert applied == [1]
