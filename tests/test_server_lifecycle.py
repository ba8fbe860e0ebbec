"""``serve`` as a real process: flags, API key from the environment, graceful SIGTERM/SIGINT."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest
from process_tree import descendants, state
from server_utils import launch_serve, wait_for
from text_model import save_text_model


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two servers, started together (start-up is mostly imports and model loading)."""
    model_dir = save_text_model(tmp_path_factory.mktemp("lifecycle-model"))
    logs = tmp_path_factory.mktemp("logs")
    started = {
        "plain": launch_serve(model_dir, logs / "plain.log"),
        "keyed": launch_serve(
            model_dir,
            logs / "keyed.log",
            "--served-model-name",
            "my-model",
            env={"PLATFORM_CORE_API_KEY": "k3y"},
        ),
    }
    try:
        for served in started.values():
            wait_for(served.healthy, 120, "a server did not become healthy")
        yield model_dir, started
    finally:
        for served in started.values():
            served.stop()


def test_sigterm_lets_the_stream_in_flight_finish_then_exits_cleanly(servers):
    model_dir, started = servers
    served = started["plain"]
    url = served.url
    assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == [str(model_dir)]
    children = descendants(served.process.pid)
    first_event, events = threading.Event(), []

    def stream():
        body = {"prompt": "The capital of", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    first_event.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first_event.wait(60)
    served.process.send_signal(signal.SIGTERM)
    reader.join(60)
    assert served.process.wait(60) == 0, served.log.read_text()
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "length"  # finished, not cut off
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=2)
    # The engine core (in process mode) was among them: it exited and was reaped.
    assert not [pid for pid in children if state(pid) is not None], "orphaned processes"


def test_sigint_stops_a_server_whose_key_comes_from_the_environment(servers):
    served = servers[1]["keyed"]
    assert httpx.get(served.url + "/v1/models").status_code == 401
    models = httpx.get(served.url + "/v1/models", headers={"authorization": "Bearer k3y"}).json()
    assert [m["id"] for m in models["data"]] == ["my-model"]
    served.process.send_signal(signal.SIGINT)
    assert served.process.wait(60) == 0, served.log.read_text()
