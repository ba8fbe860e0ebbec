"""An engine core that dies (issue #26): SIGKILLed mid-stream under load, its requests fail
with a clear error at once, ``/health`` answers 503, nothing is left unreaped; its tensor-
parallel workers go with it; ``serve`` exits with its engine-death status; and a core whose
front dies exits by itself."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import httpx
import pytest
from engine_probe import EngineProbe
from process_tree import children, cmdline, reap, state, subreaper, zombies_below
from server_utils import engine_config, launch_serve, live_server, wait_for
from text_model import save_text_model

from platform_core import SamplingParams
from platform_core.engine.process_engine import ProcessEngine
from platform_core.entrypoints.openai.api_server import ENGINE_DEATH_EXIT_STATUS

STREAMS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_text_model(tmp_path_factory.mktemp("kill-model"))


async def _read(client: httpx.AsyncClient, started: asyncio.Event) -> list[str]:
    body = {"prompt": "The capital of", "max_tokens": 200, "ignore_eos": True, "stream": True}
    events = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                started.set()
    return events


def test_a_killed_core_fails_its_streams_at_once_and_health_turns_503(model_dir, tmp_path):
    probe = EngineProbe(tmp_path)
    probe.delay = 0.02  # 200 tokens take 4 s: the streams are running when the core dies
    engine = ProcessEngine.from_config(engine_config(model_dir), engine_setup=probe.install)
    pid = engine.pid
    try:
        with live_server(engine) as url:

            async def run() -> list[list[str]]:
                async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                    started = [asyncio.Event() for _ in range(STREAMS)]
                    readers = [asyncio.create_task(_read(client, s)) for s in started]
                    for event in started:
                        await asyncio.wait_for(event.wait(), 60)
                    os.kill(pid, signal.SIGKILL)
                    return await asyncio.wait_for(asyncio.gather(*readers), 10)

            streams = asyncio.run(run())
            for events in streams:
                assert events[-1] == "[DONE]"
                error = json.loads(events[-2])["error"]
                assert error["code"] == "engine_unavailable", error
                assert "killed by SIGKILL" in error["message"], error
                assert len(events) < 200
            health = httpx.get(url + "/health")
            assert health.status_code == 503 and "SIGKILL" in health.text
            after = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert after.status_code == 503
    finally:
        engine.shutdown()
    assert not engine.is_running and "SIGKILL" in str(engine.error)
    wait_for(lambda: state(pid) is None, 10, "the killed core was not reaped")
    assert not zombies_below(os.getpid())


def test_tensor_parallel_workers_die_with_their_core(model_dir):
    config = engine_config(model_dir, tensor_parallel_size=2, worker_timeout_s=30)
    with subreaper():  # orphans of the killed core become ours, to check and reap
        engine = ProcessEngine.from_config(config)
        try:
            below = children(engine.pid)
            # forked or spawned workers; multiprocessing's resource tracker is not one
            workers = [p for p in below if "resource_tracker" not in cmdline(p)]
            assert workers, f"no tensor-parallel worker under the core: {below}"

            async def one():
                params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
                return [o async for o in engine.generate("tp", None, params, [5, 6])]

            assert asyncio.run(one())[-1].finished
            os.kill(engine.pid, signal.SIGKILL)
            wait_for(lambda: not engine.is_running, 10, "the front did not notice")
            statuses = {pid: reap(pid, 15) for pid in below}
        finally:
            engine.shutdown()
    for pid in workers:
        # The kernel closes the core's pipes before it sends the death signal, so a waiting
        # worker may see EOF and exit cleanly first; one in a collective gets the SIGKILL.
        status = statuses[pid]
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        left_on_eof = os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        assert killed or left_on_eof, status
    assert not zombies_below(os.getpid())


def _core_of(serve_pid: int) -> int:
    cores = [p for p in children(serve_pid) if "core_entry" in cmdline(p)]
    assert len(cores) == 1, [cmdline(p) for p in children(serve_pid)]
    return cores[0]


def test_serve_exits_with_the_engine_death_status_when_its_core_is_killed(model_dir, tmp_path):
    served = launch_serve(model_dir, tmp_path / "serve.log", "--engine-mode=process")
    try:
        wait_for(served.healthy, 120, "the server did not become healthy")
        core = _core_of(served.process.pid)
        os.kill(core, signal.SIGKILL)
        assert served.process.wait(15) == ENGINE_DEATH_EXIT_STATUS
        log = served.log.read_text()
        assert "the engine stopped serving" in log and "killed by SIGKILL" in log
        assert state(core) is None, "serve left its dead core unreaped"
    finally:
        served.stop()


FRONT = """
import sys, time
from server_utils import engine_config
from platform_core import SamplingParams
from platform_core.engine.process_engine import ProcessEngine
engine = ProcessEngine.from_config(engine_config(sys.argv[1]))
print(engine.pid, flush=True)
time.sleep(600)
"""


def test_a_core_whose_front_dies_exits_by_itself(model_dir):
    tests = os.path.dirname(__file__)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    with subreaper():
        front = subprocess.Popen(
            [sys.executable, "-c", FRONT, str(model_dir)],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        try:
            core = int(front.stdout.readline())
            assert state(core) not in (None, "Z")
            front.kill()
            front.wait()
            status = reap(core, 15)  # orphaned: ours now
        finally:
            front.kill()
            front.wait()
    assert os.WIFSIGNALED(status) or os.WIFEXITED(status)
    assert not zombies_below(os.getpid())
