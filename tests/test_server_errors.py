"""The server's error contract: OpenAI error bodies with 400/401/404/413/503, and never a 500."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from engine_probe import EngineProbe
from hypothesis import given, settings
from hypothesis import strategies as st
from server_utils import MODEL_NAME, engine_config, live_server, start_test_engine
from tiny_tokenizer import save_tiny_tokenizer

CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def base_url(engine):
    with live_server(engine, max_body_bytes=64 << 10) as url:
        yield url


def _assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error
    return error


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ("completions", {"prompt": "x", "temperature": -1}, "temperature"),
        ("completions", {"prompt": "x", "top_p": 0}, "top_p"),
        ("completions", {"prompt": "x", "n": 0}, "n"),
        ("completions", {"prompt": "x", "n": 1000}, "n"),
        ("completions", {"prompt": "x", "logprobs": 50}, "logprobs"),
        ("completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
        ("completions", {"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
        ("completions", {"prompt": "x", "seed": 2**70}, "seed"),
        ("completions", {"prompt": "x", "top_k": 10**30}, "top_k"),
        ("completions", {"prompt": "x", "stop": [""]}, "stop"),
        ("completions", {"prompt": "x", "stop_token_ids": [99999]}, "stop_token_ids"),
        ("completions", {"prompt": "x", "max_tokens": 100, "min_tokens": 101}, "min_tokens"),
        ("completions", {"prompt": "x", "max_tokens": 999, "min_tokens": 900}, "min_tokens"),
        ("completions", {"prompt": "x", "suffix": "y"}, "suffix"),
        ("completions", {"prompt": "x", "best_of": 3}, "best_of"),
        ("completions", {"prompt": []}, "prompt"),
        ("completions", {"prompt": [[]]}, "prompt"),
        ("completions", {"prompt": [99999]}, "prompt"),
        ("completions", {"prompt": ["a", 1]}, "prompt"),
        ("completions", {"prompt": "word " * 400}, "prompt"),
        ("completions", {}, "prompt"),
        ("chat/completions", {"messages": []}, "messages"),
        (
            "chat/completions",
            {"messages": [{"role": "user"}], "tools": [{"type": "function"}]},
            "tools",
        ),
        ("chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
        (
            "chat/completions",
            {"messages": CHAT, "logprobs": True, "top_logprobs": 50},
            "top_logprobs",
        ),
        (
            "chat/completions",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                    }
                ]
            },
            "messages.0.content",
        ),
        ("chat/completions", {"messages": [{"content": "no role"}]}, "messages.0.role"),
    ],
)
def test_invalid_requests_are_400_naming_the_param(base_url, route, body, param):
    error = _assert_error(httpx.post(f"{base_url}/v1/{route}", json=body), 400, param)
    assert error["type"] == "invalid_request_error"


def test_a_prompt_longer_than_the_context_says_so(base_url, engine):
    error = _assert_error(
        httpx.post(base_url + "/v1/completions", json={"prompt": list(range(5, 300))}), 400
    )
    assert str(engine.max_model_len) in error["message"]


def test_malformed_json_is_400(base_url):
    response = httpx.post(
        base_url + "/v1/completions",
        content=b'{"prompt": "x",',
        headers={"content-type": "application/json"},
    )
    _assert_error(response, 400)


def test_unknown_model_and_route_are_404(base_url):
    for route, body in (
        ("/v1/completions", {"prompt": "x", "model": "gpt-nope"}),
        ("/v1/chat/completions", {"messages": CHAT, "model": "gpt-nope"}),
        ("/tokenize", {"prompt": "x", "model": "gpt-nope"}),
    ):
        error = _assert_error(httpx.post(base_url + route, json=body), 404, "model")
        assert error["code"] == "model_not_found" and "gpt-nope" in error["message"]
    _assert_error(httpx.get(base_url + "/v1/nothing-here"), 404)
    _assert_error(httpx.get(base_url + "/v1/completions"), 405)
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-nope", prompt="x")


def test_a_model_without_chat_template_answers_chat_with_400(model_dir, tmp_path):
    save_tiny_tokenizer(tmp_path)  # the same tokenizer, without a chat template
    engine = start_test_engine(engine_config(model_dir, tokenizer=str(tmp_path)))
    try:
        with live_server(engine) as url:
            error = _assert_error(
                httpx.post(url + "/v1/chat/completions", json={"messages": CHAT}), 400, "messages"
            )
            assert "chat template" in error["message"]
            completion = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert completion.status_code == 200
    finally:
        engine.shutdown()


def test_api_key_guards_every_route_but_health_and_metrics(engine):
    with live_server(engine, api_key="s3cret", guard_metrics=True) as url:
        _assert_error(httpx.get(url + "/metrics"), 401)  # guarded on request
    with live_server(engine, api_key="s3cret") as url:
        assert httpx.get(url + "/metrics").status_code == 200  # open by default
        for path in ("/v1/models", "/version"):
            _assert_error(httpx.get(url + path), 401)
            _assert_error(httpx.get(url + path, headers={"authorization": "Bearer wrong"}), 401)
            assert (
                httpx.get(url + path, headers={"authorization": "Bearer s3cret"}).status_code == 200
            )
        _assert_error(httpx.post(url + "/v1/completions", json={"prompt": "x"}), 401)
        assert httpx.get(url + "/health").status_code == 200
        wrong = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        right = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert right.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2).choices


def test_oversized_bodies_are_413(engine):
    with live_server(engine, max_body_bytes=2048) as url:
        big = {"prompt": "x" * 3000, "max_tokens": 1}
        error = _assert_error(httpx.post(url + "/v1/completions", json=big), 413)
        assert "2048" in error["message"]

        def chunked():  # no content-length: the limit is counted while reading
            for _ in range(4):
                yield json.dumps(big).encode()[:1000]

        _assert_error(httpx.post(url + "/v1/completions", content=chunked()), 413)
        small = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert small.status_code == 200


def test_a_dead_engine_gives_503_in_responses_streams_and_health(model_dir, tmp_path):
    probe = EngineProbe(tmp_path)
    probe.fail_after(3, "device lost")  # the stream below has started by then
    engine = start_test_engine(engine_config(model_dir), probe)
    try:
        with live_server(engine) as url:
            body = {"prompt": "x", "max_tokens": 50, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body) as stream:
                assert stream.status_code == 200
                events = [line for line in stream.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            error = json.loads(events[-2].removeprefix("data: "))["error"]
            assert error["code"] == "engine_unavailable" and "device lost" in error["message"]
            after = httpx.post(url + "/v1/completions", json={"prompt": "x"})
            assert _assert_error(after, 503)["code"] == "engine_unavailable"
            _assert_error(httpx.get(url + "/health"), 503)
    finally:
        engine.shutdown()


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
_KEYS = [
    "prompt",
    "messages",
    "max_tokens",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "seed",
    "logprobs",
    "top_logprobs",
    "echo",
    "logit_bias",
    "stream",
    "stop_token_ids",
    "min_tokens",
    "repetition_penalty",
    "tokens",
    "best_of",
]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    route=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]),
    body=st.dictionaries(st.sampled_from(_KEYS), _JSON, max_size=4)
    | st.fixed_dictionaries(
        {"prompt": st.just("hi"), "max_tokens": st.integers(-2, 40)},
        optional={k: _JSON for k in _KEYS if k not in ("prompt", "max_tokens")},
    ),
)
def test_arbitrary_bodies_never_get_a_500(base_url, engine, route, body):
    response = httpx.post(
        base_url + route,
        content=json.dumps(body),
        timeout=60,
        headers={"content-type": "application/json"},
    )
    assert response.status_code in (200, 400, 404), response.text
    assert engine.is_running
