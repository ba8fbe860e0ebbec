"""vLLM's extra routes and route options against a live loopback server: ``/tokenize`` with
vLLM's fields, ``/invocations`` and ``/ping`` (SageMaker), ``/tokenizer_info``, ``--root-path``;
and the offline ``LLM`` methods vLLM scripts call."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_utils import ENGINE_KEYS, MODEL_NAME, launch_serve, live_server, wait_for
from text_model import CHATML_TEMPLATE
from transformers import AutoTokenizer

from platform_core.entrypoints.llm import LLM

API_KEY = "routes-key"
ROOT = "/proxy"
MESSAGES = [{"role": "user", "content": "hello there"}]
# Renders what the tiny model's own template ignores: tools and a template variable.
TOOLS_TEMPLATE = (
    "{% for tool in tools %}[{{ tool['function']['name'] }}]{% endfor %}"
    "{{ greeting }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def proxied_url(engine):
    """A server behind a proxy prefix, with an API key, request templates trusted and
    ``/tokenizer_info`` on."""
    with live_server(
        engine,
        api_key=API_KEY,
        root_path=ROOT,
        trust_request_chat_template=True,
        enable_tokenizer_info_endpoint=True,
    ) as url:
        yield url


def keyed(url: str, path: str, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.post(url + path, headers=headers, timeout=30, **kwargs)


def chat_ids(tokenizer, messages, **kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def test_tokenize_answers_in_vllms_shape_with_its_defaults(base_url, hf_tokenizer):
    text = "hello there"
    plain = httpx.post(base_url + "/tokenize", json={"prompt": text}).json()
    assert plain == {
        "count": len(hf_tokenizer.encode(text)),
        "max_model_len": ENGINE_KEYS["max_model_len"],
        "tokens": hf_tokenizer.encode(text),
        "token_strs": None,
    }
    chat = httpx.post(base_url + "/tokenize", json={"messages": MESSAGES}).json()
    expected = chat_ids(hf_tokenizer, MESSAGES, add_generation_prompt=True)
    assert chat["tokens"] == expected  # messages: the template's own special tokens only
    strs = httpx.post(base_url + "/tokenize", json={"prompt": text, "return_token_strs": True})
    assert strs.json()["token_strs"] == hf_tokenizer.convert_ids_to_tokens(plain["tokens"])


def test_tokenize_continue_final_message_leaves_the_last_turn_open(base_url, hf_tokenizer):
    messages = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    body = {"messages": messages, "continue_final_message": True}
    got = httpx.post(base_url + "/tokenize", json=body).json()["tokens"]
    assert got == chat_ids(hf_tokenizer, messages, continue_final_message=True)
    closed = chat_ids(hf_tokenizer, messages, add_generation_prompt=False)
    assert got == closed[: len(got)] and len(got) < len(closed)  # no end-of-turn after it
    both = httpx.post(base_url + "/tokenize", json={**body, "add_generation_prompt": True})
    assert both.status_code == 400
    assert "continue_final_message and add_generation_prompt" in both.json()["error"]["message"]


def test_tokenize_renders_tools_and_template_kwargs(proxied_url, hf_tokenizer):
    body = {
        "messages": MESSAGES,
        "tools": TOOLS,
        "chat_template": TOOLS_TEMPLATE,
        "chat_template_kwargs": {"greeting": "hi!"},
        "return_token_strs": True,
    }
    got = keyed(proxied_url, "/tokenize", json=body).json()
    expected = hf_tokenizer.encode("[get_weather]hi!user: hello there\n", add_special_tokens=False)
    assert got["tokens"] == expected and got["count"] == len(expected)
    assert got["token_strs"] == hf_tokenizer.convert_ids_to_tokens(expected)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": MESSAGES, "chat_template": TOOLS_TEMPLATE}, "chat_template"),
        (
            {"messages": MESSAGES, "chat_template_kwargs": {"chat_template": TOOLS_TEMPLATE}},
            "chat_template_kwargs.chat_template",
        ),
        (
            {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}},
            "chat_template_kwargs.tokenize",
        ),
        ({"messages": MESSAGES, "tools": "get_weather"}, "tools"),
    ],
)
def test_tokenize_refuses_untrusted_templates_and_reserved_kwargs(base_url, body, param):
    response = httpx.post(base_url + "/tokenize", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_tokenize_names_unknown_fields_in_the_header(base_url):
    response = httpx.post(base_url + "/tokenize", json={"prompt": "hi", "frobnicate": 1})
    assert response.status_code == 200
    assert response.headers["x-platform-core-ignored-fields"] == "frobnicate"


def test_tokenize_chat_fields_with_a_prompt_are_a_400(base_url):
    response = httpx.post(base_url + "/tokenize", json={"prompt": "hi", "tools": TOOLS})
    assert response.status_code == 400
    assert "tools apply to 'messages'" in response.json()["error"]["message"]


def test_invocations_route_by_body_shape(base_url):
    chat_body = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0}
    completion_body = {"prompt": "hello there", "max_tokens": 6, "temperature": 0}
    for body, path, kind in (
        (chat_body, "/v1/chat/completions", "chat.completion"),
        (completion_body, "/v1/completions", "text_completion"),
    ):
        direct = httpx.post(base_url + path, json=body, timeout=30).json()
        invoked = httpx.post(base_url + "/invocations", json=body, timeout=30).json()
        assert invoked["object"] == direct["object"] == kind
        assert invoked["choices"] == direct["choices"]
        # The second request may hit the prefix cache: compare the counts, not the hits.
        assert invoked["usage"]["total_tokens"] == direct["usage"]["total_tokens"]
    with httpx.stream(
        "POST", base_url + "/invocations", json={**completion_body, "stream": True}, timeout=30
    ) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) > 2


@pytest.mark.parametrize(
    ("content", "param", "text"),
    [
        (b'{"input": "hi"}', None, "with 'messages'"),
        (b"[1, 2]", None, "with 'prompt'"),
        (b'{"prompt": "hi", "max_tokens": "six"}', "max_tokens", "max_tokens"),
        (b'{"messages": [], "max_tokens": 2}', "messages", "messages"),
        (b'{"prompt": "hi"', None, "not valid JSON"),
        (b'{"prompt": "\xff"}', None, "not valid JSON"),
    ],
)
def test_invocations_bad_bodies_are_400s(base_url, content, param, text):
    response = httpx.post(base_url + "/invocations", content=content)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and text in error["message"]


def test_ping_answers_like_health(base_url):
    assert httpx.get(base_url + "/ping").status_code == 200
    assert httpx.post(base_url + "/ping").status_code == 200


def test_tokenizer_info_is_opt_in_and_behind_the_key(base_url, proxied_url, hf_tokenizer):
    assert httpx.get(base_url + "/tokenizer_info").status_code == 404  # off by default
    assert httpx.get(proxied_url + "/tokenizer_info").status_code == 401
    response = httpx.get(
        proxied_url + ROOT + "/tokenizer_info", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    info = response.json()
    assert response.status_code == 200
    assert info["tokenizer_class"] == type(hf_tokenizer).__name__
    assert info["chat_template"] == CHATML_TEMPLATE
    assert info["eos_token"] == hf_tokenizer.eos_token  # an AddedToken, sent as its text
    assert "vocab_file" not in info and "tokenizer_file" not in info


@pytest.mark.parametrize("prefix", [ROOT, ""], ids=["prefix-kept", "prefix-stripped"])
def test_root_path_serves_routes_and_links_under_the_prefix(proxied_url, prefix):
    client = openai.OpenAI(base_url=proxied_url + prefix + "/v1", api_key=API_KEY)
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    completion = client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=3)
    assert completion.usage.completion_tokens == 3
    assert httpx.get(proxied_url + prefix + "/health").status_code == 200  # open, no key
    assert httpx.get(proxied_url + prefix + "/ping").status_code == 200
    assert httpx.get(proxied_url + prefix + "/v1/models").status_code == 401
    schema = httpx.get(proxied_url + prefix + "/openapi.json", headers=client.auth_headers)
    assert schema.json()["servers"] == [{"url": ROOT}]  # what the server links to


def test_llm_offers_vllms_tokenizer_and_engine_accessors(model_dir, hf_tokenizer):
    llm = LLM(str(model_dir), **ENGINE_KEYS)
    tokenizer = llm.get_tokenizer()
    assert tokenizer is llm.tokenizer and llm.llm_engine is llm.engine
    assert tokenizer.encode("hello there") == hf_tokenizer.encode("hello there")


def test_serve_flags_reach_the_app(model_dir, tmp_path):
    flags = (
        "--root-path",
        ROOT,
        "--enable-tokenizer-info-endpoint",
        "--trust-request-chat-template",
        "--return-tokens-as-token-ids",  # read by the completions code; here: it parses
    )
    served = launch_serve(model_dir, tmp_path / "serve.log", *flags)
    try:
        wait_for(served.healthy, 120, "serve did not become healthy")
        assert httpx.get(served.url + ROOT + "/tokenizer_info").json()["chat_template"]
        body = {"messages": MESSAGES, "chat_template": TOOLS_TEMPLATE, "tools": TOOLS}
        tokens = httpx.post(served.url + ROOT + "/tokenize", json=body, timeout=30)
        assert tokens.status_code == 200, tokens.text
        schema = httpx.get(served.url + "/openapi.json").json()
        assert schema["servers"] == [{"url": ROOT}]
    finally:
        served.stop()
