"""Hostile and sloppy request bodies over loopback (issues #21 and #27): strict types, lone
surrogates, bytes that are not UTF-8, NULs and non-characters, logit-bias keys, the largest seed.
Each is a 400 naming the field, or served; never a 5xx."""

from __future__ import annotations

import httpx
import pytest
from server_utils import expect_error, post_raw

CHAT = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "n": True}, "n"),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2.0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "echo": 1}, "echo"),
        ("/v1/completions", {"prompt": "x", "temperature": "0.5"}, "temperature"),
        ("/v1/completions", {"prompt": [1, True]}, "prompt"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"１２": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {" 12": 1}}, "logit_bias"),
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": 1}, "logprobs"),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "stream_options": {"include_usage": 1}},
            "stream_options",
        ),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "false"}, "add_special_tokens"),
    ],
)
def test_lax_values_are_400_naming_the_field(base_url, route, body, param):
    expect_error(httpx.post(base_url + route, json=body), 400, param)


def test_numbers_stay_numbers(base_url):
    body = {"prompt": "x", "max_tokens": 2, "temperature": 0, "top_p": 1, "logit_bias": {"5": 1}}
    assert httpx.post(base_url + "/v1/completions", json=body, timeout=60).status_code == 200


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "\udfff"]}, "prompt.1"),
        ("/v1/completions", {"prompt": "x", "stop": "\ud800"}, "stop"),
        ("/v1/completions", {"prompt": "x", "stop": ["ok", "\ud800"]}, "stop.1"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"\ud800": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "model": "\ud800"}, "model"),
        ("/v1/completions", {"prompt": "x", "\ud800": 1}, None),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "\ud800"}]},
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udbff"}]}]},
            "messages.0.content.0.text",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "\ud800", "content": "x"}]},
            "messages.0.role",
        ),
        ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ],
)
def test_lone_surrogates_are_400_naming_the_field(base_url, route, body, param):
    error = expect_error(post_raw(base_url, body, route), 400, param)
    assert error["type"] == "invalid_request_error"


# Raw bytes that are not UTF-8 where a text goes (0xFF, a cut sequence, an overlong form), in a
# small body and in one over the off-loop decoding threshold.
INVALID_UTF8 = [b"\xff\xfe", b"\xc3(", b"\xe2\x82", b"\xc0\xaf"]


@pytest.mark.parametrize("bad", INVALID_UTF8, ids=lambda b: b.hex())
@pytest.mark.parametrize(
    ("route", "template"),
    [
        ("/v1/completions", b'{"prompt": "a%sb", "max_tokens": 2}'),
        ("/v1/completions", b'{"prompt": "x", "stop": ["%s"], "max_tokens": 2}'),
        ("/v1/completions", b'{"prompt": "x", "logit_bias": {"%s": 1}, "max_tokens": 2}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "%s"}]}'),
        ("/v1/completions", b'{"prompt": "%s' + b"a" * (300 << 10) + b'", "max_tokens": 2}'),
    ],
    ids=["prompt", "stop", "logit_bias", "message", "big-body"],
)
def test_invalid_utf8_bytes_are_400(base_url, route, template, bad):
    response = httpx.post(
        base_url + route,
        content=template.replace(b"%s", bad),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    error = expect_error(response, 400)
    assert "invalid UTF-8" in error["message"], error


@pytest.mark.parametrize("text", ["NUL\x00here", "non-character \ufffe\uffff\ufdd0 here"])
def test_nuls_and_non_characters_are_served(base_url, text):
    completion = post_raw(base_url, {"prompt": text, "max_tokens": 2, "stop": [text[:4], text]})
    assert completion.status_code == 200, completion.text
    chat = post_raw(
        base_url,
        {"messages": [{"role": "user", "content": text}], "max_tokens": 2},
        "/v1/chat/completions",
    )
    assert chat.status_code == 200, chat.text
    tokens = post_raw(base_url, {"prompt": text, "add_special_tokens": False}, "/tokenize")
    assert tokens.status_code == 200
    back = post_raw(base_url, {"tokens": tokens.json()["tokens"]}, "/detokenize")
    assert back.json()["prompt"] == text


@pytest.mark.parametrize("key", ["1\x00", "\ufffe", "\uffff1", "", " 1", "1e3"])
def test_logit_bias_keys_that_are_not_plain_digits_are_400(base_url, key):
    body = {"prompt": "x", "max_tokens": 2, "logit_bias": {key: 1}}
    assert expect_error(post_raw(base_url, body), 400)["param"].startswith("logit_bias")


def test_the_largest_seed_with_n_forks_is_served(base_url):
    body = {"prompt": "x", "seed": 2**63 - 1, "n": 4, "max_tokens": 3}
    response = httpx.post(base_url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 4
