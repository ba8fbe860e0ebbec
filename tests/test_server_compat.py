"""vLLM compatibility of the completions and chat protocol (issue 21), with the real ``openai``
client (and ``httpx`` where the raw body or headers matter) against a live loopback server."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from server_utils import MODEL_NAME, live_server

from platform_core.entrypoints.openai.responses import IGNORED_FIELDS_HEADER

CHAT = [{"role": "user", "content": "Hello there"}]
PROMPT = "The cat sat on the"


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def _post(base_url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/{route}", json=body, timeout=60)


def _error_param(response: httpx.Response) -> str:
    assert response.status_code == 400, response.text
    return response.json()["error"]["param"]


# ---------------------------------------------------------------- 1. unknown fields are ignored
def test_unknown_fields_are_ignored_and_named_in_a_header(base_url, caplog):
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Hi", "extra_field": 1}],
        "max_tokens": 2,
        "frobnicate": {"a": 1},
    }
    with caplog.at_level("INFO", logger="platform_core.server"):
        response = _post(base_url, "chat/completions", body)
    assert response.status_code == 200, response.text
    assert response.headers[IGNORED_FIELDS_HEADER] == "frobnicate,messages.0.extra_field"
    lines = [r.getMessage() for r in caplog.records if "ignored unknown" in r.getMessage()]
    assert len(lines) == 1 and "frobnicate, messages.0.extra_field" in lines[0]
    known = _post(base_url, "completions", {"prompt": PROMPT, "max_tokens": 1})
    assert IGNORED_FIELDS_HEADER not in known.headers


def test_openai_sdk_fields_just_work(client):
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_tokens=2,
        store=False,
        metadata={"k": "v"},
        service_tier="auto",
        parallel_tool_calls=False,
        user="me",
        tools=[],
    )
    assert chat.choices[0].finish_reason == "length"
    completion = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, suffix="")
    assert len(completion.choices) == 1


def test_strict_request_fields_restores_the_400(engine):
    with live_server(engine, strict_request_fields=True) as url:
        body = {"messages": [{"role": "user", "content": "Hi", "extra_field": 1}]}
        response = _post(url, "chat/completions", body)
        assert _error_param(response) == "messages.0.extra_field"
        assert "unsupported parameter" in response.json()["error"]["message"]
        assert _post(url, "completions", {"prompt": "x", "max_tokens": 1}).status_code == 200


def test_hostile_unknown_field_names_stay_one_ascii_header(base_url):
    body = {"prompt": PROMPT, "max_tokens": 1, "a\nbé": 1}
    body.update({f"f{i:04d}" * 8: i for i in range(200)})
    response = _post(base_url, "completions", body)
    assert response.status_code == 200, response.text
    header = response.headers[IGNORED_FIELDS_HEADER]
    assert header.isascii() and "\n" not in header and header.startswith("a\\nb\\u00e9,")
    assert header.endswith(",...") and len(header) <= 2048 + 4


# ------------------------------------------------------------------- 2. one choice per chunk
@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_streams_carry_one_choice_per_chunk(client, route):
    common = {"model": MODEL_NAME, "max_tokens": 4, "temperature": 0, "stream": True}
    if route == "completions":
        chunks = list(client.completions.create(prompt=[PROMPT, "Water is"], n=2, **common))
        choices = 4
    else:
        chunks = list(client.chat.completions.create(messages=CHAT, n=2, **common))
        choices = 2
    assert chunks and all(len(c.choices) == 1 for c in chunks)
    assert {c.choices[0].index for c in chunks} == set(range(choices))
    finished = [c.choices[0].index for c in chunks if c.choices[0].finish_reason]
    assert sorted(finished) == list(range(choices))


# ------------------------------------------------------------------ 3. always-present fields
def test_vllm_fields_are_present_as_null_and_created_is_now(client, base_url):
    before = int(time.time())
    completion = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
    choice = completion.choices[0]
    assert choice.prompt_logprobs is None and choice.prompt_token_ids is None
    assert choice.token_ids is None
    assert before <= completion.created <= int(time.time())
    raw = _post(base_url, "chat/completions", {"messages": CHAT, "max_tokens": 2}).json()
    assert raw["prompt_logprobs"] is None and raw["prompt_token_ids"] is None
    assert raw["choices"][0]["token_ids"] is None and raw["created"] >= before


# ------------------------------------------------------------------------ 4. vLLM's options
def test_return_token_ids(client, engine):
    completion = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=3,
        extra_body={"return_token_ids": True, "ignore_eos": True},  # 3 tokens, whatever is drawn
    )
    choice = completion.choices[0]
    assert choice.prompt_token_ids == engine.tokenizer.encode(PROMPT)
    assert len(choice.token_ids) == 3
    # The text holds back a last character whose UTF-8 bytes are not all out yet (decode
    # shows it as U+FFFD); the tiny byte-level tokenizer draws such tokens often.
    decoded = engine.tokenizer.decode(choice.token_ids)
    assert decoded.startswith(choice.text) and set(decoded[len(choice.text) :]) <= {"\ufffd"}
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=CHAT,
            max_tokens=3,
            stream=True,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
    )
    assert chunks[0].prompt_token_ids and all(c.prompt_token_ids is None for c in chunks[1:])
    assert sum(len(c.choices[0].token_ids) for c in chunks) == 3


def test_prompt_logprobs_and_echo_without_generation(client, engine):
    ids = engine.tokenizer.encode(PROMPT)
    scored = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    positions = scored.choices[0].prompt_logprobs
    assert len(positions) == len(ids) and positions[0] is None
    for token, position in zip(ids[1:], positions[1:]):
        assert str(token) in position and len(position) <= 3
        assert all(entry["logprob"] <= 0 for entry in position.values())
    # lm-eval's loglikelihood request, with max_tokens 0: the prompt and its logprobs only.
    echoed = client.completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=0, echo=True, logprobs=1
    )
    choice = echoed.choices[0]
    assert choice.text == engine.tokenizer.decode(ids)
    assert len(choice.logprobs.token_logprobs) == len(ids)
    assert choice.logprobs.token_logprobs[0] is None
    want = [positions[i][str(t)]["logprob"] for i, t in enumerate(ids) if i]
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-5)
    assert echoed.usage.completion_tokens == 0


def test_return_tokens_as_token_ids(client, engine):
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_tokens=2,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
    )
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in chat.choices[0].token_ids]
    assert all(t.token.startswith("token_id:") for c in content for t in c.top_logprobs)
    with live_server(engine, return_tokens_as_token_ids=True) as url:
        body = {"prompt": PROMPT, "max_tokens": 2, "logprobs": 1}
        tokens = _post(url, "completions", body).json()["choices"][0]["logprobs"]["tokens"]
        assert len(tokens) == 2 and all(t.startswith("token_id:") for t in tokens)


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, engine, base_url):
    ids = engine.tokenizer.encode("word " * 400)
    assert len(ids) > engine.max_model_len
    completion = client.completions.create(
        model=MODEL_NAME,
        prompt="word " * 400,
        max_tokens=1,
        extra_body={"truncate_prompt_tokens": 10, "return_token_ids": True},
    )
    assert completion.choices[0].prompt_token_ids == ids[-10:]
    assert completion.usage.prompt_tokens == 10
    body = {"prompt": PROMPT, "truncate_prompt_tokens": 10_000}
    assert _error_param(_post(base_url, "completions", body)) == "truncate_prompt_tokens"


def test_usage_in_streams_continuous_and_forced(client, engine):
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": False, "continuous_usage_stats": True},
        )
    )
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 3
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    with live_server(engine, enable_force_include_usage=True) as url:
        forced = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        chunks = list(
            forced.chat.completions.create(
                model=MODEL_NAME, messages=CHAT, max_tokens=2, stream=True
            )
        )
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2


def test_stream_options_without_stream_is_a_400(base_url):
    body = {"prompt": PROMPT, "stream_options": {"include_usage": True}}
    assert _error_param(_post(base_url, "completions", body)) == "stream_options"


def test_chat_template_options(client, base_url, engine):
    reply = [*CHAT, {"role": "assistant", "content": "The answer"}]
    continued = client.chat.completions.create(
        model=MODEL_NAME,
        messages=reply,
        max_tokens=2,
        temperature=0,
        extra_body={
            "continue_final_message": True,
            "add_generation_prompt": False,
            "echo": True,
            "return_token_ids": True,
        },
    )
    assert continued.choices[0].message.content.startswith("The answer")
    rendered = engine.tokenizer.apply_chat_template(
        reply, tokenize=False, continue_final_message=True, add_generation_prompt=False
    )
    ids = engine.tokenizer.encode(rendered, add_special_tokens=False)
    assert continued.model_extra["prompt_token_ids"] == ids
    both = {"messages": reply, "continue_final_message": True}
    assert _error_param(_post(base_url, "chat/completions", both)) == "continue_final_message"
    kwargs = {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}
    assert _error_param(_post(base_url, "chat/completions", kwargs)).startswith(
        "chat_template_kwargs"
    )
    own = {"messages": CHAT, "chat_template": "{{ messages[0]['content'] }}", "max_tokens": 1}
    assert _error_param(_post(base_url, "chat/completions", own)) == "chat_template"
    with live_server(engine, trust_request_chat_template=True) as url:
        body = {**own, "return_token_ids": True}
        response = _post(url, "chat/completions", body).json()
        assert response["prompt_token_ids"] == engine.tokenizer.encode(
            "Hello there", add_special_tokens=False
        )


def test_top_logprobs_minus_one_means_the_whole_vocabulary(base_url, engine):
    body = {"messages": CHAT, "logprobs": True, "top_logprobs": -1, "max_tokens": 1}
    response = _post(base_url, "chat/completions", body)
    assert _error_param(response) == "top_logprobs"
    message = response.json()["error"]["message"]
    assert f"{engine.vocab_size} tokens" in message and "20" in message
    body = {"messages": CHAT, "logprobs": True, "top_logprobs": -2}
    assert _error_param(_post(base_url, "chat/completions", body)) == "top_logprobs"


def test_a_bad_logit_bias_key_is_named(base_url):
    response = _post(base_url, "completions", {"prompt": PROMPT, "logit_bias": {"abc": 1}})
    assert _error_param(response).startswith("logit_bias")
    assert "abc" in response.json()["error"]["message"]
