"""``kv_transfer_params`` over HTTP (prefill/decode disaggregation, #23): a request's reach the
engine with its one ``GenerateRequest``, and what the engine's KV connector returned comes back
at the top of the response (of a stream: on the chunk that finishes the request); beam search,
several prompts and anything but a JSON object are 400s.

The engine is a stand-in (``RecordingEngine``) that records what it is given and answers as a
prefill instance's connector would: the real engine refuses the params without a connector.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import openai
import pytest
from server_utils import MODEL_NAME, expect_error
from transformers import AutoTokenizer

from platform_core.engine.outputs import CompletionOutput, RequestOutput
from platform_core.engine.request_stream import (
    GenerateRequest,
    RequestStream,
    StreamSink,
    SubmitFront,
)

DECODE_HERE = {"do_remote_decode": True}
MESSAGES = [{"role": "user", "content": "Hi"}]


def connector_params(request: GenerateRequest) -> dict:
    """What ``RecordingEngine`` returns for ``request``: where a decode instance finds it."""
    return {
        "do_remote_prefill": True,
        "remote_engine_id": "prefill-0",
        "remote_request_id": request.request_id,
        "remote_address": {"host": "127.0.0.1", "port": 14579},
        "remote_num_tokens": len(request.prompt_token_ids or []),
    }


class RecordingEngine(SubmitFront):
    """Keeps every request it is given and finishes each at once with two tokens per choice;
    a request that brought ``kv_transfer_params`` gets ``connector_params`` on its output."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = 256
        self.eos_token_ids = frozenset({tokenizer.eos_token_id})
        self.vocab_size = len(tokenizer)
        self.default_sampling = {}
        self.error = None
        self.requests: list[GenerateRequest] = []

    @property
    def is_running(self) -> bool:
        return True

    def abort(self, request_ids: list[str]) -> None:
        pass

    def shutdown(self, timeout: float | None = 30.0) -> None:
        pass

    async def submit(self, requests, *, max_buffered_tokens=None) -> RequestStream:
        self.requests += requests
        ids = [r.request_id for r in requests]
        sink = StreamSink(asyncio.get_running_loop(), ids, self.abort)
        sink.accepted.set_result(None)
        for request in requests:
            sink.put(self._finished(request))
        return RequestStream(ids, sink, self.abort)

    def _finished(self, request: GenerateRequest) -> RequestOutput:
        choices = [
            CompletionOutput(i, "ok", [5, 6], finish_reason="length")
            for i in range(request.params.n)
        ]
        params = None if request.kv_transfer_params is None else connector_params(request)
        return RequestOutput(
            request.request_id,
            request.prompt,
            request.prompt_token_ids or [],
            choices,
            finished=True,
            kv_transfer_params=params,
        )


@pytest.fixture(scope="module")
def engine(text_model_dir: Path) -> RecordingEngine:
    return RecordingEngine(AutoTokenizer.from_pretrained(text_model_dir))


@pytest.fixture
def recorded(engine: RecordingEngine) -> list[GenerateRequest]:
    """The requests the engine is given during the test."""
    engine.requests.clear()
    return engine.requests


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json={"model": MODEL_NAME, **body}, timeout=30)


def _events(response: httpx.Response) -> list[dict]:
    """The JSON events of a server-sent event stream, ``[DONE]`` left out."""
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
    assert lines[-1] == "[DONE]", response.text
    return [json.loads(line) for line in lines[:-1]]


def test_completion_params_reach_the_engine_and_come_back(client, recorded):
    response = client.completions.create(
        model=MODEL_NAME,
        prompt="Hello",
        max_tokens=1,
        extra_body={"kv_transfer_params": DECODE_HERE},
    )
    (request,) = recorded
    assert request.kv_transfer_params == DECODE_HERE
    assert response.model_extra["kv_transfer_params"] == connector_params(request)


def test_chat_params_reach_the_engine_and_come_back(client, recorded):
    remote = {"do_remote_prefill": True, "remote_request_id": "cmpl-p-0", "remote_num_tokens": 9}
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_completion_tokens=4,
        extra_body={"kv_transfer_params": remote},
    )
    (request,) = recorded
    assert request.kv_transfer_params == remote  # opaque: passed on as sent
    assert response.model_extra["kv_transfer_params"] == connector_params(request)


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/completions", {"prompt": "Hello"}), ("/v1/chat/completions", {"messages": MESSAGES})],
)
def test_without_params_the_engine_gets_none_and_the_field_is_null(base_url, recorded, path, body):
    response = _post(base_url, path, body)
    assert response.status_code == 200, response.text
    assert [r.kv_transfer_params for r in recorded] == [None]
    assert response.json()["kv_transfer_params"] is None


def test_one_prompt_with_n_choices_is_one_request_with_the_params(base_url, recorded):
    response = _post(
        base_url, "/v1/completions", {"prompt": "Hello", "n": 2, "kv_transfer_params": DECODE_HERE}
    )
    assert response.status_code == 200, response.text
    (request,) = recorded
    assert request.params.n == 2 and request.kv_transfer_params == DECODE_HERE
    assert response.json()["kv_transfer_params"] == connector_params(request)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "Hello", "n": 2}),
        ("/v1/chat/completions", {"messages": MESSAGES, "n": 2}),
    ],
)
def test_a_stream_carries_the_params_on_the_chunk_that_finishes_it(base_url, recorded, path, body):
    body = {**body, "stream": True, "kv_transfer_params": DECODE_HERE}
    body["stream_options"] = {"include_usage": True}
    response = _post(base_url, path, body)
    assert response.status_code == 200, response.text
    (request,) = recorded
    *choices, usage = _events(response)
    assert len(choices) == 2 and usage["choices"] == [] and usage["kv_transfer_params"] is None
    assert [c["kv_transfer_params"] for c in choices] == [None, connector_params(request)]


@pytest.mark.parametrize(
    "value", ["do_remote_decode", ["do_remote_decode"], 1, True], ids=["str", "list", "int", "bool"]
)
@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/completions", {"prompt": "Hello"}), ("/v1/chat/completions", {"messages": MESSAGES})],
)
def test_params_that_are_not_an_object_are_a_400(base_url, recorded, path, body, value):
    error = expect_error(
        _post(base_url, path, {**body, "kv_transfer_params": value}), 400, "kv_transfer_params"
    )
    assert error["type"] == "invalid_request_error"
    assert not recorded


@pytest.mark.parametrize(
    ("path", "body", "reason"),
    [
        ("/v1/completions", {"prompt": ["Hello", "Bye"]}, "2 prompts"),
        ("/v1/completions", {"prompt": [[5, 6], [7]], "n": 2}, "2 prompts"),
        ("/v1/completions", {"prompt": "Hello", "n": 2, "use_beam_search": True}, "beam search"),
        ("/v1/chat/completions", {"messages": MESSAGES, "use_beam_search": True}, "beam search"),
    ],
)
def test_params_for_several_requests_are_a_400(base_url, recorded, path, body, reason):
    response = _post(base_url, path, {**body, "kv_transfer_params": DECODE_HERE})
    error = expect_error(response, 400, "kv_transfer_params")
    assert reason in error["message"]
    assert not recorded
