"""Tool calling through the chat route, with the real ``openai`` client.

The default model (the structured-output tests' server) answers forced calls (``tool_choice``
"required" or a named function), constrained to the call schema: every call must parse, name a
given tool and match its parameters schema. The tiny text model's shared engine, served with
``--tool-call-parser hermes --enable-auto-tool-choice``, checks "auto" parsing end to end, its
output forced into a hermes call by a choice constraint; and the 400s.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from server_utils import MODEL_NAME, expect_error, live_server, post_raw
from test_server_structured_outputs import SMOL
from test_server_structured_outputs import smol as smol  # the default model's server

CITY = {"type": "string", "pattern": "^[A-Z][a-z]{2,11}$"}
WEATHER = {
    "type": "object",
    "properties": {"city": CITY, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {
        "timezone": {"type": "string", "pattern": "^[A-Z][a-z]{2,11}/[A-Z][a-z]{2,11}$"}
    },
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Time now", "parameters": TIME},
    },
]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}
# name -> (request settings, whether streamed). Sampled, the small model goes on adding calls
# to a "required" array until max_tokens: those modes ask for one call.
SINGLE = {"temperature": 0.8, "n": 2, "parallel_tool_calls": False}
MODES: dict[str, tuple[dict[str, Any], bool]] = {
    "greedy": ({"temperature": 0}, False),
    "sampled": ({**SINGLE, "seed": 5}, False),
    "streamed": ({**SINGLE, "seed": 9}, True),
}
HERMES_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def calls_of(response: Any, stream: bool) -> list[tuple[list[dict], str | None, str | None]]:
    """``(calls, content, finish_reason)`` per choice; a call is ``{id, name, arguments}``."""
    if not stream:
        return [
            (
                [
                    {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                    for c in choice.message.tool_calls or []
                ],
                choice.message.content,
                choice.finish_reason,
            )
            for choice in response.choices
        ]
    calls: dict[int, dict[int, dict]] = {}
    content: dict[int, str | None] = {}
    finish: dict[int, str | None] = {}
    for chunk in response:
        for choice in chunk.choices:
            i = choice.index
            calls.setdefault(i, {})
            if choice.delta.content:
                content[i] = (content.get(i) or "") + choice.delta.content
            for piece in choice.delta.tool_calls or []:
                call = calls[i].setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = piece.id or call["id"]
                if piece.function is not None:
                    call["name"] += piece.function.name or ""
                    call["arguments"] += piece.function.arguments or ""
            finish[i] = choice.finish_reason or finish.get(i)
    return [
        ([calls[i][k] for k in sorted(calls[i])], content.get(i), finish[i]) for i in sorted(calls)
    ]


def check_calls(calls: list[dict], names: set[str]) -> None:
    """Every call names one of ``names``, has an id, and its arguments match its schema."""
    assert calls
    for call in calls:
        assert call["name"] in names, call
        assert call["id"].startswith("call_"), call
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])


# ------------------------------------------------------------------ the default model: forced
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_forced_calls_parse_and_match_the_tool_schema(smol, tool_choice, mode):
    settings, stream = MODES[mode]
    response = smol.chat.completions.create(
        model=SMOL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required" if tool_choice == "required" else NAMED,
        max_tokens=150,
        stream=stream,
        **settings,
    )
    choices = calls_of(response, stream)
    assert len(choices) == settings.get("n", 1)
    names = set(PARAMETERS) if tool_choice == "required" else {"get_time"}
    for calls, content, finish_reason in choices:
        assert finish_reason == "tool_calls" and content is None, (calls, content)
        check_calls(calls, names)
        if tool_choice == "named":
            assert len(calls) == 1


def test_no_parallel_tool_calls_makes_exactly_one_call(smol):
    response = smol.chat.completions.create(
        model=SMOL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0.8,
        seed=3,
        n=3,
    )
    for calls, _, finish_reason in calls_of(response, stream=False):
        assert finish_reason == "tool_calls" and len(calls) == 1
        check_calls(calls, set(PARAMETERS))


def test_a_conversation_with_tool_results_renders_and_answers(smol):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    response = smol.chat.completions.create(
        model=SMOL, messages=messages, tools=TOOLS, max_tokens=8, temperature=0
    )
    choice = response.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert choice.message.content and choice.message.tool_calls is None


# --------------------------------------------------- the tiny model: "auto" with the hermes parser
@pytest.fixture(scope="module")
def hermes(engine: Any) -> Iterator[openai.OpenAI]:
    """A client of a server on the shared tiny engine that parses hermes calls."""
    with live_server(engine, tool_call_parser="hermes", enable_auto_tool_choice=True) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def ask_tiny(client: openai.OpenAI, stream: bool, **kwargs: Any) -> Any:
    """The question with ``TOOLS`` to the tiny model (up to 120 tokens unless told)."""
    kwargs.setdefault("max_tokens", 120)
    return client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, stream=stream, **kwargs
    )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_parses_a_hermes_call(hermes, stream):
    response = ask_tiny(
        hermes, stream, extra_body={"structured_outputs": {"choice": [HERMES_CALL]}}
    )
    [(calls, content, finish_reason)] = calls_of(response, stream)
    assert finish_reason == "tool_calls"
    assert not content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert calls[0]["id"].startswith("call_")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_output_without_calls_is_content(hermes, stream):
    response = ask_tiny(hermes, stream, extra_body={"structured_outputs": {"choice": ["sunny"]}})
    assert calls_of(response, stream) == [([], "sunny", "stop")]


def test_tool_choice_none_leaves_a_call_as_content(hermes):
    response = ask_tiny(
        hermes,
        False,
        tool_choice="none",
        extra_body={"structured_outputs": {"choice": [HERMES_CALL]}},
    )
    assert calls_of(response, False) == [([], HERMES_CALL, "stop")]


def test_a_forced_call_cut_short_is_content_with_length(hermes):
    response = ask_tiny(hermes, False, tool_choice="required", max_tokens=4)
    [(calls, content, finish_reason)] = calls_of(response, False)
    assert calls == [] and finish_reason == "length" and content


# ------------------------------------------------------------------------------------ the 400s
BAD_TOOLS = {
    "unknown function": (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    "tool without a name": (
        {"tools": [{"type": "function", "function": {}}], "tool_choice": "required"},
        "tools",
    ),
    "tool_choice without tools": ({"tool_choice": "required"}, "tool_choice"),
    "forced call and a constraint": (
        {"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"},
        "tool_choice",
    ),
}


@pytest.mark.parametrize("case", BAD_TOOLS)
def test_bad_tool_requests_are_400(base_url, case):
    fields, param = BAD_TOOLS[case]
    body = {"messages": ASK, "max_tokens": 4, **fields}
    expect_error(post_raw(base_url, body, "/v1/chat/completions"), 400, param)


def test_auto_needs_the_server_flags(base_url):
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "auto"}
    error = expect_error(post_raw(base_url, body, "/v1/chat/completions"), 400, "tool_choice")
    assert "--enable-auto-tool-choice" in error["message"]


def test_tools_default_to_no_parsing_without_the_flags(base_url):
    body = {
        "messages": ASK,
        "tools": TOOLS,
        "structured_outputs": {"choice": [HERMES_CALL]},
        "max_tokens": 120,
    }
    response = post_raw(base_url, body, "/v1/chat/completions")
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["message"]["content"] == HERMES_CALL and choice["finish_reason"] == "stop"
