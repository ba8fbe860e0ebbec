"""Starting child processes: the start-up handshake, failures reported at once, the start method.

Every test checks that the children it started are gone and reaped afterwards.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from platform_core.distributed import start_method
from platform_core.distributed.process_start import ChildProcess, start_child, wait_ready
from platform_core.distributed.start_method import (
    START_METHOD_ENV,
    StartMethod,
    choose_start_method,
)
from platform_core.errors import ConfigError, ProcessStartError

pytestmark = pytest.mark.usefixtures("no_child_processes_left")
FORK = StartMethod("fork", "test")
SPAWN = StartMethod("spawn", "test")


@pytest.fixture
def started():
    """Children a test starts; all stopped (and reaped) after it, whatever happened."""
    children: list[ChildProcess] = []
    yield children
    for child in children:
        child.conn.close()  # an echoing child exits when its pipe closes: no 5 s wait for it
        child.stop(timeout_s=5)


# ---------------------------------------------------------------- child targets (module level:
# a spawned child imports them by name)


def _ready_then_echo(link, value):
    link.ready(value)
    while True:
        try:
            message = link.conn.recv()
        except EOFError:
            return
        link.conn.send(("echo", message))


def _raise_while_starting(link, text):
    raise RuntimeError(text)


def _kill_myself(link):
    os.kill(os.getpid(), signal.SIGKILL)


def _return_without_ready(link):
    return


def _never_ready(link):
    link.conn.recv()  # until the parent closes its end


def _parallel_work_then_ready(link):
    torch.set_num_threads(2)
    a = torch.randn(512, 512)  # the parent's generator state, copied by the fork
    link.ready(float((a @ a).sum()))


class _ExitWhenUnpickled:
    """Pickles fine; unpickling it (in a spawned child, before any of our code runs) exits 7."""

    def __reduce__(self):
        return os._exit, (7,)


# ---------------------------------------------------------------- the handshake


@pytest.mark.parametrize("method", [FORK, SPAWN], ids=["fork", "spawn"])
def test_ready_values_come_back_in_order_and_the_pipe_is_the_callers_after(method, started):
    for index in range(2):
        started.append(start_child(_ready_then_echo, (f"value {index}",), f"child{index}", method))
    assert wait_ready(started, timeout_s=120) == ["value 0", "value 1"]
    assert all(child.started and child.ready for child in started)
    started[1].conn.send("hello")
    assert started[1].conn.recv() == ("echo", "hello")  # nothing of the handshake left over
    for child in started:
        child.conn.close()  # end of file: the child returns
        child.process.join(30)
        assert child.process.exitcode == 0


@pytest.mark.parametrize("method", [FORK, SPAWN], ids=["fork", "spawn"])
def test_a_target_that_raises_while_starting_fails_with_its_traceback(method, started):
    started.append(start_child(_ready_then_echo, ("fine",), "bystander", method))
    started.append(start_child(_raise_while_starting, ("injected: no model",), "broken", method))
    with pytest.raises(ProcessStartError) as failure:
        wait_ready(started, timeout_s=120)
    message = str(failure.value)
    assert message.startswith("broken (pid ")
    assert "failed while starting" in message
    assert "Traceback" in message and "RuntimeError: injected: no model" in message


def test_a_child_killed_while_starting_is_named_with_its_signal(started):
    started.append(start_child(_kill_myself, (), "victim", FORK))
    with pytest.raises(ProcessStartError, match=r"victim \(pid \d+\) was killed by SIGKILL"):
        wait_ready(started, timeout_s=60)


def test_a_spawned_child_that_dies_before_it_starts_is_reported_with_its_exit_code(started):
    started.append(start_child(_ready_then_echo, (_ExitWhenUnpickled(),), "early", SPAWN))
    with pytest.raises(ProcessStartError) as failure:
        wait_ready(started, timeout_s=120)
    assert "exited with code 7 before it started" in str(failure.value)
    assert "failed to import the main module or its target" in str(failure.value)


def test_returning_without_ready_is_a_failure(started):
    started.append(start_child(_return_without_ready, (), "quitter", FORK))
    with pytest.raises(ProcessStartError, match="_return_without_ready returned before it was"):
        wait_ready(started, timeout_s=60)


def test_a_child_that_never_gets_ready_times_out_and_is_stopped(started):
    started.append(start_child(_never_ready, (), "sleeper", FORK))
    with pytest.raises(ProcessStartError, match=r"sleeper did not become ready in 0\.5 s"):
        wait_ready(started, timeout_s=0.5)
    started[0].stop(timeout_s=0)
    assert started[0].process.exitcode == -signal.SIGTERM


def test_forked_children_see_end_of_file_when_the_parent_closes_its_end(started):
    # The second child is forked while the parent holds the first one's pipe: it must not keep
    # a copy of it open, or the first would never see the parent go.
    for name in ("first", "second"):
        started.append(start_child(_ready_then_echo, (name,), name, FORK))
    wait_ready(started, timeout_s=60)
    started[0].conn.close()
    started[0].process.join(30)
    assert started[0].process.exitcode == 0
    assert started[1].process.is_alive()


def test_a_child_forked_after_parallel_work_can_do_parallel_work(started):
    # libgomp's pool threads do not exist in a forked child; without releasing the pool first,
    # the child's first parallel region waits for them forever.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(0)
        a = torch.randn(512, 512)
        expected = float((a @ a).sum())  # a parallel region: the pool's threads now exist
        torch.manual_seed(0)
        started.append(start_child(_parallel_work_then_ready, (), "after-omp", FORK))
    finally:
        torch.set_num_threads(threads)
    assert wait_ready(started, timeout_s=60) == [expected]


# ---------------------------------------------------------------- choosing the start method


def test_a_forced_method_is_kept(monkeypatch):
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    assert choose_start_method("spawn").name == "spawn"
    assert choose_start_method("fork").name == "fork"


def test_the_environment_decides_for_auto_and_is_validated(monkeypatch):
    monkeypatch.setenv(START_METHOD_ENV, "spawn")
    assert choose_start_method("auto") == StartMethod("spawn", f"spawn ${START_METHOD_ENV}")
    assert choose_start_method("fork").name == "fork"  # an explicit setting wins
    monkeypatch.setenv(START_METHOD_ENV, "forkserver")
    with pytest.raises(ConfigError, match=rf"got 'forkserver' \(\${START_METHOD_ENV}\)"):
        choose_start_method("auto")


def test_another_running_thread_makes_auto_spawn(monkeypatch):
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    stop = threading.Event()
    bystander = threading.Thread(target=stop.wait, name="bystander")
    bystander.start()
    try:
        method = choose_start_method("auto")
    finally:
        stop.set()
        bystander.join()
    assert method.name == "spawn"
    assert "other threads are running (" in method.reason and "bystander" in method.reason


def test_an_initialised_accelerator_runtime_makes_auto_spawn(monkeypatch):
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    method = choose_start_method("auto")
    assert method.name == "spawn"
    assert "torch.cuda is initialised" in method.reason
    assert "torch.cuda is initialised" in start_method.fork_hazards()
