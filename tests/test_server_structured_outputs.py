"""Structured outputs through the server: ``response_format``, vLLM's ``structured_outputs`` and
its older ``guided_*`` fields, on both routes, with the real ``openai`` client.

The default model (SmolLM2-135M-Instruct, one server for the module) writes the JSON, regex,
choice and grammar outputs that are checked; the tiny text model's shared server checks how
each field reaches the engine and the 400s. Every string in the schemas is bounded by a
``pattern``, not ``maxLength``: xgrammar 0.2's length-bounded strings admit raw control
characters, which no JSON parser takes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Annotated, Any, Literal

import jsonschema
import openai
import pytest
from engine_probe import EngineProbe
from pydantic import BaseModel, Field
from server_utils import (
    MODEL_NAME,
    assert_engine_clean,
    expect_error,
    live_server,
    post_raw,
    start_test_engine,
)

from platform_core.config import EngineConfig

SMOL = "smollm2-135m-instruct"
NAME = {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"}
PERSON = {
    "type": "object",
    "properties": {
        "name": NAME,
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "job": {"enum": ["engineer", "doctor", "teacher"]},
        "nickname": NAME,  # optional
        "address": {
            "type": "object",
            "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "job", "address"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "$defs": {
        "item": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                "price": {"type": "number", "minimum": 0, "maximum": 100},
            },
            "required": ["sku", "quantity", "price"],
            "additionalProperties": False,
        }
    },
    "properties": {
        "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 3},
        "express": {"type": "boolean"},  # optional
    },
    "required": ["items"],
    "additionalProperties": False,
}
READINGS = {
    "type": "array",
    "items": {"type": "number", "minimum": -50, "maximum": 50},
    "minItems": 2,
    "maxItems": 4,
}
SCHEMAS = {
    "person": (PERSON, "Describe a person as JSON: name, age, job and address."),
    "order": (ORDER, "Write a shop order as JSON: a list of items with sku, quantity, price."),
    "readings": (READINGS, "List a few temperature readings in Celsius as a JSON array."),
}
# name -> (sampling settings, whether streamed)
MODES: dict[str, tuple[dict[str, Any], bool]] = {
    "greedy": ({"temperature": 0}, False),
    "sampled": ({"temperature": 0.8, "seed": 7, "n": 2}, False),
    "streamed": ({"temperature": 0.8, "seed": 11, "n": 2}, True),
}


class Landmark(BaseModel):
    name: Annotated[str, Field(pattern=r"^[A-Z][a-z]{2,11}( [A-Z][a-z]{2,11})?$")]


class City(BaseModel):
    name: Annotated[str, Field(pattern=r"^[A-Z][a-z]{2,11}$")]
    country: Literal["France", "Italy", "Spain"]
    population: Annotated[int, Field(ge=0, le=50_000_000)]
    landmarks: Annotated[list[Landmark], Field(min_length=1, max_length=2)]


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    """An ``openai`` client of a server on the default model, checked clean at the end."""
    probe = EngineProbe(tmp_path_factory.mktemp("probe"))
    config = EngineConfig.from_flat(
        dtype="float32", max_model_len=512, kv_cache_memory_bytes=128 << 20, seed=0
    )  # no model: the packaged default
    engine = start_test_engine(config, probe)
    try:
        with live_server(engine, SMOL) as url:
            yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert_engine_clean(engine, probe)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def tiny(base_url: str) -> openai.OpenAI:
    """An ``openai`` client of the shared server on the tiny text model."""
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


def ask(client: openai.OpenAI, model: str, route: str, text: str, **kwargs: Any) -> Any:
    """One request on ``route`` ("chat" or "completions"), ``text`` its prompt or message."""
    if route == "chat":
        messages = [{"role": "user", "content": text}]
        return client.chat.completions.create(model=model, messages=messages, **kwargs)
    return client.completions.create(model=model, prompt=text, **kwargs)


def texts(response: Any) -> list[tuple[str, str | None]]:
    """``(text, finish_reason)`` of each choice of a whole chat or completion response."""
    return [
        (c.message.content if hasattr(c, "message") else c.text, c.finish_reason)
        for c in response.choices
    ]


def streamed(chunks: Any) -> list[tuple[str, str | None]]:
    """``(text, finish_reason)`` of each choice of a chat stream, deltas concatenated."""
    parts: dict[int, list[str]] = {}
    finish: dict[int, str | None] = {}
    for chunk in chunks:
        for c in chunk.choices:
            parts.setdefault(c.index, []).append(c.delta.content or "")
            finish[c.index] = c.finish_reason or finish.get(c.index)
    return [("".join(parts[i]), finish[i]) for i in sorted(parts)]


# ------------------------------------------------------------------ the default model's outputs
def test_parse_returns_an_instance_of_the_pydantic_model(smol):
    completion = smol.chat.completions.parse(
        model=SMOL,
        messages=[{"role": "user", "content": "Tell me about Paris as JSON."}],
        response_format=City,
        max_tokens=150,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City), choice.message.content
    assert City.model_validate_json(choice.message.content) == choice.message.parsed


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("schema_name", SCHEMAS)
def test_every_output_matches_its_json_schema(smol, schema_name, mode):
    schema, instruction = SCHEMAS[schema_name]
    settings, stream = MODES[mode]
    response = ask(
        smol,
        SMOL,
        "chat",
        instruction,
        max_tokens=200,
        stream=stream,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        **settings,
    )
    outputs = streamed(response) if stream else texts(response)
    assert len(outputs) == settings.get("n", 1)
    for text, finish_reason in outputs:
        assert finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)


def is_json_object(text: str) -> bool:
    return isinstance(json.loads(text), dict)


DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
PHONE = r"\+1 [0-9]{3} [0-9]{4}"
CAPITALS = ["London", "Paris", "Berlin"]
ANSWERS = ["yes", "no", "maybe so"]
# name -> (instruction, extra body, check of the output)
CONSTRAINTS: dict[str, tuple[str, dict[str, Any], Callable[[str], Any]]] = {
    "guided_regex": (
        "Give a date.",
        {"guided_regex": DATE},
        lambda t: re.fullmatch(DATE, t),
    ),
    "structured_outputs.regex": (
        "Give a phone number.",
        {"structured_outputs": {"regex": PHONE}},
        lambda t: re.fullmatch(PHONE, t),
    ),
    "guided_choice": (
        "What is the capital of France?",
        {"guided_choice": CAPITALS},
        lambda t: t in CAPITALS,
    ),
    "structured_outputs.choice": (
        "Is the sky blue?",
        {"structured_outputs": {"choice": ANSWERS}},
        lambda t: t in ANSWERS,
    ),
    "guided_grammar": (
        "Add two small numbers.",
        {"guided_grammar": 'root ::= num " + " num " = " num\nnum ::= [1-9] [0-9]?'},
        lambda t: re.fullmatch(r"[1-9][0-9]? \+ [1-9][0-9]? = [1-9][0-9]?", t),
    ),
    "structured_outputs.grammar": (
        "Name a colour.",
        {"structured_outputs": {"grammar": 'root ::= "colour: " ("red" | "green" | "blue")'}},
        lambda t: t in ("colour: red", "colour: green", "colour: blue"),
    ),
    "json_object": (
        "Describe a cat as a JSON object with its name and age.",
        {"response_format": {"type": "json_object"}},
        is_json_object,
    ),
}


@pytest.mark.parametrize("constraint", CONSTRAINTS)
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_regex_choice_grammar_and_json_object_outputs_match(smol, route, constraint):
    instruction, extra_body, check = CONSTRAINTS[constraint]
    response = ask(
        smol, SMOL, route, instruction, max_tokens=150, temperature=0, extra_body=extra_body
    )
    [(text, finish_reason)] = texts(response)
    assert finish_reason == "stop", text
    assert check(text), text


# ------------------------------------------------ the tiny model: mapping, finish reasons, 400s
YES_NO = {
    "type": "object",
    "properties": {"k": {"enum": ["yes", "no"]}},
    "required": ["k"],
    "additionalProperties": False,
}
# name -> (extra body, the outputs it allows)
MAPPINGS: dict[str, tuple[dict[str, Any], set[str]]] = {
    "response_format.json_schema": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "k", "schema": YES_NO, "strict": True},
            },
            "structured_outputs": {"disable_any_whitespace": True},
        },
        {'{"k": "yes"}', '{"k": "no"}'},  # xgrammar's fixed separators, no other whitespace
    ),
    "response_format.structural_tag": (
        {
            "response_format": {
                "type": "structural_tag",
                "format": {"type": "const_string", "value": "<done/>"},
            }
        },
        {"<done/>"},
    ),
    "structured_outputs.json": (
        {"structured_outputs": {"json": {"enum": [1, 22]}}},
        {"1", "22"},
    ),
    "guided_json": ({"guided_json": '{"enum": ["a", "b"]}'}, {'"a"', '"b"'}),
    "guided_regex": ({"guided_regex": "[ab]c"}, {"ac", "bc"}),
    "guided_choice": ({"guided_choice": ["one", "two words"]}, {"one", "two words"}),
    "guided_grammar": ({"guided_grammar": 'root ::= "x" | "yy"'}, {"x", "yy"}),
}


@pytest.mark.parametrize("mapping", MAPPINGS)
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_each_field_constrains_the_output(tiny, route, mapping):
    extra_body, allowed = MAPPINGS[mapping]
    response = ask(
        tiny,
        MODEL_NAME,
        route,
        "hello",
        max_tokens=20,
        temperature=1,
        seed=3,
        n=3,
        extra_body=extra_body,
    )
    for text, finish_reason in texts(response):
        assert text in allowed and finish_reason == "stop", (text, finish_reason)


def test_vllm_structures_and_triggers_are_accepted(tiny):
    tag = {
        "type": "structural_tag",
        "structures": [{"begin": "<n>", "schema": {"type": "integer"}, "end": "</n>"}],
        "triggers": ["<n>"],
    }
    response = ask(
        tiny, MODEL_NAME, "chat", "hi", max_tokens=8, extra_body={"response_format": tag}
    )
    assert response.choices[0].finish_reason in ("stop", "length")


def test_a_constrained_output_cut_at_max_tokens_finishes_with_length(tiny):
    response = ask(
        tiny, MODEL_NAME, "completions", "hi", max_tokens=5, extra_body={"guided_regex": "[ab]{40}"}
    )
    [(text, finish_reason)] = texts(response)
    assert finish_reason == "length"
    assert re.fullmatch("[ab]{5}", text), text  # each token of the tiny tokenizer is a byte here


TEXT_FORMAT = {"response_format": {"type": "text"}}


def test_response_format_text_leaves_the_output_free(tiny):
    free = ask(tiny, MODEL_NAME, "chat", "hi", max_tokens=12, temperature=0)
    text = ask(tiny, MODEL_NAME, "chat", "hi", max_tokens=12, temperature=0, extra_body=TEXT_FORMAT)
    assert texts(text) == texts(free)


SCHEMA = {"name": "x", "schema": {"type": "integer"}}
# name -> (extra body, param, words the message must contain)
REFUSED: dict[str, tuple[dict[str, Any], str, tuple[str, ...]]] = {
    "invalid schema": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            }
        },
        "structured_outputs",
        ("nonsense",),
    ),
    "invalid regex": ({"guided_regex": "(ab"}, "structured_outputs", ("regex",)),
    "invalid grammar": (
        {"structured_outputs": {"grammar": "root ::= (("}},
        "structured_outputs",
        ("grammar",),
    ),
    "two constraints": (
        {"response_format": {"type": "json_schema", "json_schema": SCHEMA}, "guided_regex": "a"},
        "guided_regex",
        ("response_format", "guided_regex"),
    ),
    "two in structured_outputs": (
        {"structured_outputs": {"regex": "a", "choice": ["b"]}},
        "structured_outputs.choice",
        ("structured_outputs.regex", "structured_outputs.choice"),
    ),
    "unknown structured_outputs key": (
        {"structured_outputs": {"regex": "a", "jsonn": {}}},
        "structured_outputs",
        ("jsonn",),
    ),
    "options without a constraint": (
        {"structured_outputs": {"disable_any_whitespace": True}},
        "structured_outputs",
        ("exactly one",),
    ),
    "json_schema without schema": (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema",
        ("json_schema.schema",),
    ),
    "field of another type": (
        {"response_format": {"type": "json_object", "json_schema": SCHEMA}},
        "response_format.json_schema",
        ("json_object",),
    ),
    "unknown response_format type": (
        {"response_format": {"type": "xml"}},
        "response_format.type",
        ("json_schema",),
    ),
    "empty choice": ({"guided_choice": []}, "structured_outputs", ("choice",)),
    "guided_whitespace_pattern": (
        {"guided_json": SCHEMA["schema"], "guided_whitespace_pattern": " *"},
        "guided_whitespace_pattern",
        ("disable_any_whitespace",),
    ),
    "guided_decoding_backend": (
        {"guided_regex": "a", "guided_decoding_backend": "outlines"},
        "guided_decoding_backend",
        ("--structured-outputs-backend",),
    ),
    "beam search": (
        {"guided_regex": "a", "use_beam_search": True, "n": 2},
        "use_beam_search",
        ("beam",),
    ),
}


@pytest.mark.parametrize("case", REFUSED)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_bad_constraint_is_a_400_naming_the_problem(base_url, path, case):
    extra, param, words = REFUSED[case]
    error = expect_error(post_raw(base_url, request_body(path, extra), path), 400, param)
    assert error["type"] == "invalid_request_error"
    for word in words:
        assert word.lower() in error["message"].lower(), error


@pytest.mark.parametrize("case", ["invalid schema", "two constraints"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_streamed_request_with_a_bad_constraint_is_a_400_not_a_stream(base_url, path, case):
    extra, param, _ = REFUSED[case]
    expect_error(
        post_raw(base_url, request_body(path, {**extra, "stream": True}), path), 400, param
    )


def request_body(path: str, extra: dict[str, Any]) -> dict[str, Any]:
    """A short request to ``path`` with ``extra`` fields."""
    if path == "/v1/completions":
        prompt: dict[str, Any] = {"prompt": "hi"}
    else:
        prompt = {"messages": [{"role": "user", "content": "hi"}]}
    return {"model": MODEL_NAME, "max_tokens": 4, **prompt, **extra}
