"""Tool-call parsers: whole-output and streamed extraction, hostile output, registry, forced
tool-call schemas."""

from __future__ import annotations

import copy
import importlib.metadata
import json
import random
import re
import sys
import types
from importlib.metadata import EntryPoint

import jsonschema
import pytest

from platform_core.entrypoints.openai.tool_parsers import (
    ENTRY_POINT_GROUP,
    ExtractedToolCalls,
    ParsedCall,
    ToolCall,
    ToolParser,
    forced_tool_calls_schema,
    get_tool_parser,
    new_call_id,
    parse_forced_tool_calls,
    register_tool_parser,
    tool_parser_names,
)
from platform_core.entrypoints.openai.tool_parsers import registry as tool_registry
from platform_core.errors import ConfigError, InvalidRequestError
from platform_core.parsing.plugin_registry import UnknownParserError

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "units": "metric"}}'
WEATHER_ARGS = {"city": "Paris", "units": "metric"}

# parser -> [(output, [(name, arguments)], content)]
CASES = {
    "hermes": [
        (
            f"Let me check.\n\n<tool_call>\n{WEATHER}\n</tool_call>",
            [("get_weather", WEATHER_ARGS)],
            "Let me check.",
        ),
        (
            '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n'
            '{"name": "b", "arguments": {"x": [1, {"y": "}</tool_call"}]}}\n</tool_call>\n',
            [("a", {}), ("b", {"x": [1, {"y": "}</tool_call"}]})],
            None,
        ),
        ("Just text, with a <tool_ mention.\n", [], "Just text, with a <tool_ mention.\n"),
        ("<tool_call>{not json}</tool_call>", [], "<tool_call>{not json}</tool_call>"),
        (
            '<tool_call>{"arguments": {}}</tool_call>',
            [],
            '<tool_call>{"arguments": {}}</tool_call>',
        ),
        (
            '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',
            [],
            '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',
        ),
        ('<tool_call>\n{"name": "a", "arguments": {"q": "x"}}\n', [("a", {"q": "x"})], None),
        ('<tool_call>{"name": "a", "argu', [], '<tool_call>{"name": "a", "argu'),
        ('A\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\nB\n', [("a", {})], "A\nB"),
        (
            '<tool_call>{"name": "k", "arguments": "{\\"city\\": \\"Köln\\"}"}</tool_call>',
            [("k", {"city": "Köln"})],
            None,
        ),
        (
            '<tool_call>{"name": "n", "arguments": {"x": NaN}}</tool_call>',
            [],
            '<tool_call>{"name": "n", "arguments": {"x": NaN}}</tool_call>',
        ),
        ("<tool_call>", [], "<tool_call>"),
    ],
    "llama3_json": [
        (
            '<|python_tag|>{"name": "get_weather", "parameters": '
            '{"city": "Paris", "units": "metric"}}',
            [("get_weather", WEATHER_ARGS)],
            None,
        ),
        (
            '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": "z;}"}}',
            [("a", {"x": 1}), ("b", {"y": "z;}"})],
            None,
        ),
        (
            '\n{"name": "a", "parameters": {}}\n{"name": "b", "parameters": {}}\n',
            [("a", {}), ("b", {})],
            None,
        ),
        ('{"name": "a", "parameters": {}} and then prose', [("a", {})], "and then prose"),
        ('The answer is {"name": "a"}.', [], 'The answer is {"name": "a"}.'),
        ('{"answer": 42}', [], '{"answer": 42}'),
        ('{"name": "a", "parameters": {"x": ', [], '{"name": "a", "parameters": {"x": '),
        ("  \n", [], "  \n"),
        ("<|python_tag|>print(1)", [], "print(1)"),
        ("<|python_ta", [], "<|python_ta"),
    ],
    "pythonic": [
        (
            "[get_weather(city='Paris', units=\"metric\"), other(x=1)]",
            [("get_weather", WEATHER_ARGS), ("other", {"x": 1})],
            None,
        ),
        (
            " [f(x=[1, (2, 3)], y={'a': None}, z=True, w=-1.5)]",
            [("f", {"x": [1, [2, 3]], "y": {"a": None}, "z": True, "w": -1.5})],
            None,
        ),
        ("[f()]", [("f", {})], None),
        ("[f(s='a]b', t='\\'')] done", [("f", {"s": "a]b", "t": "'"})], "done"),
        ("[f(x=__import__('os'))]", [], "[f(x=__import__('os'))]"),
        ("[f(x=open('/etc/passwd').read())]", [], "[f(x=open('/etc/passwd').read())]"),
        ("[f(1)]", [], "[f(1)]"),
        ("[f(**k)]", [], "[f(**k)]"),
        ("[obj.method(x=1)]", [], "[obj.method(x=1)]"),
        ("[f(x=1e999), g(y=1)]", [], "[f(x=1e999), g(y=1)]"),
        ("[f(x={1, 2})]", [], "[f(x={1, 2})]"),
        ("[1, 2] is a list", [], "[1, 2] is a list"),
        ("[]", [], "[]"),
        ("Sure: [f(x=1)]", [], "Sure: [f(x=1)]"),
        ("[f(x=1)", [], "[f(x=1)"),
        ("[f(x='open)]", [], "[f(x='open)]"),
    ],
}
ALL_CASES = [(name, *case) for name, cases in CASES.items() for case in cases]


def _parser(name: str) -> ToolParser:
    return get_tool_parser(name)(None)


def _stream(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Stream ``pieces``; the joined content and each call's (name, joined arguments), checking
    the OpenAI shape on the way: a call's first delta has its id and name, no later one has."""
    text, deltas = "", []
    for piece in pieces:
        deltas.append(parser.extract_tool_calls_streaming(text, text + piece, piece))
        text += piece
    deltas.append(parser.finish(text))
    calls: dict[int, dict] = {}
    content = ""
    for delta in filter(None, deltas):
        assert delta.content or delta.tool_calls, "a delta carries something, or is None"
        content += delta.content or ""
        for call in delta.tool_calls:
            if call.index in calls:
                assert call.id is None and call.name is None
                calls[call.index]["arguments"] += call.arguments or ""
            else:
                assert re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id or "") and call.name
                calls[call.index] = {"name": call.name, "arguments": call.arguments or ""}
    assert sorted(calls) == list(range(len(calls))), "indices count up from 0"
    return content, [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]


def _splits(text: str, rng: random.Random, fixed: bool = True):
    """Every fixed piece size (when ``fixed``), then random cuts."""
    if fixed:
        for size in range(1, len(text) + 1):
            yield [text[i : i + size] for i in range(0, len(text), size)]
    for _ in range(20):
        if len(text) < 2:
            break
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _summary(result: ExtractedToolCalls) -> tuple[str, list[tuple[str, str]]]:
    return result.content or "", [(call.name, call.arguments) for call in result.tool_calls]


@pytest.mark.parametrize("name,output,calls,content", ALL_CASES)
def test_whole_output_extraction(name, output, calls, content):
    result = _parser(name).extract_tool_calls(output, tools=None)
    assert result.tools_called == bool(calls)
    assert [(call.name, json.loads(call.arguments)) for call in result.tool_calls] == calls
    assert result.content == content
    ids = [call.id for call in result.tool_calls]
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids) and len(set(ids)) == len(ids)


def test_arguments_keep_non_ascii_text():
    [call] = (
        _parser("hermes")
        .extract_tool_calls(
            '<tool_call>{"name": "k", "arguments": {"city": "Köln"}}</tool_call>', None
        )
        .tool_calls
    )
    assert call.arguments == '{"city": "Köln"}'


@pytest.mark.parametrize("name,output", [(case[0], case[1]) for case in ALL_CASES])
def test_streamed_extraction_equals_whole_output_at_every_cut(name, output):
    expected = _summary(_parser(name).extract_tool_calls(output, None))
    for pieces in _splits(output, random.Random(0)):
        assert _stream(_parser(name), pieces) == expected, pieces


FUZZ_ATOMS = [
    "<tool_call>", "</tool_call>", "<|python_tag|>", WEATHER, "f(x=1)", "{", "}", "[", "]", "(",
    ")", '"', "'", "\\", ":", ",", ";", "=", " ", "\n", '"name"', '"a"', '"arguments"',
    '"parameters"', "1", "x", "<", "tool", "__import__('os')",
]  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_output_never_raises_and_streams_like_the_whole(name):
    rng = random.Random(1234)
    for _ in range(300):
        output = "".join(rng.choice(FUZZ_ATOMS) for _ in range(rng.randint(1, 12)))
        expected = _summary(_parser(name).extract_tool_calls(output, None))
        for pieces in _splits(output, rng, fixed=False):
            assert _stream(_parser(name), pieces) == expected, pieces


@pytest.mark.parametrize("name", sorted(CASES))
def test_absurdly_deep_nesting_is_content(name):
    deep = "[" * 100_000 + "]" * 100_000
    for output in (deep, f"<tool_call>{deep}</tool_call>", '{"name": "f", "arguments": ' + deep):
        result = _parser(name).extract_tool_calls(output, None)
        assert (result.tools_called, result.content) == (False, output)
    assert parse_forced_tool_calls(deep, "required") == []


def test_a_call_is_sent_once_complete_and_content_around_it_streams():
    parser = _parser("hermes")
    first = parser.extract_tool_calls_streaming("", "Checking.\n<tool_", "Checking.\n<tool_")
    assert first is not None and first.content == "Checking." and not first.tool_calls
    text = "Checking.\n<tool_"
    assert parser.extract_tool_calls_streaming(text, text + 'call>{"name"', 'call>{"name"') is None
    text += 'call>{"name"'
    rest = ': "a", "arguments": {"x": 1}}</tool_call>'
    delta = parser.extract_tool_calls_streaming(text, text + rest, rest)
    assert delta is not None and delta.content is None
    [call] = delta.tool_calls
    assert (call.index, call.name, call.arguments) == (0, "a", '{"x": 1}')
    assert parser.finish(text + rest) is None


def test_new_call_ids_are_openai_shaped_and_unique():
    ids = {new_call_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)


def test_registry_names_and_unknown_name_error():
    assert {"hermes", "llama3_json", "pythonic"} <= set(tool_parser_names())
    with pytest.raises(UnknownParserError, match="unknown tool parser 'nope'") as info:
        get_tool_parser("nope")
    assert isinstance(info.value, ConfigError)
    assert {"hermes", "llama3_json", "pythonic"} <= set(info.value.known)
    assert "hermes" in str(info.value)
    with pytest.raises(ConfigError, match="already registered"):
        register_tool_parser("hermes")(type("Other", (ToolParser,), {"new_splitter": None}))


class ShoutSplitter:
    """A third-party format: ``CALL name`` on a line of its own."""

    def __init__(self) -> None:
        self._text = ""

    def feed(self, text):
        self._text += text
        return []

    def finish(self):
        if self._text.startswith("CALL "):
            return [ParsedCall(self._text[5:].strip(), "{}")]
        return [self._text]


class ShoutToolParser(ToolParser):
    def new_splitter(self):
        return ShoutSplitter()


def test_third_party_parser_through_an_entry_point(monkeypatch, caplog):
    module = types.ModuleType("fake_tool_plugin")
    module.ShoutToolParser = ShoutToolParser
    monkeypatch.setitem(sys.modules, "fake_tool_plugin", module)
    eps = [
        EntryPoint("shout", "fake_tool_plugin:ShoutToolParser", ENTRY_POINT_GROUP),
        EntryPoint("broken", "no_such_module_for_tests:Parser", ENTRY_POINT_GROUP),
    ]
    real = importlib.metadata.entry_points
    monkeypatch.setattr(
        importlib.metadata,
        "entry_points",
        lambda **params: eps if params.get("group") == ENTRY_POINT_GROUP else real(**params),
    )
    fresh = copy.deepcopy(tool_registry._REGISTRY)
    fresh._plugins_loaded = False
    monkeypatch.setattr(tool_registry, "_REGISTRY", fresh)

    parser = get_tool_parser("shout")(None)
    result = parser.extract_tool_calls("CALL lights_on", None)
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("lights_on", "{}")]
    assert _stream(get_tool_parser("shout")(None), ["CA", "LL lig", "hts_on"]) == (
        "",
        [("lights_on", "{}")],
    )
    assert set(tool_parser_names()) == {*CASES, "shout"}
    with pytest.raises(ConfigError, match=r"'broken' failed to load"):
        get_tool_parser("broken")
    assert "broken" in caplog.text


# -- forced tool calls ----------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "pick",
            # as pydantic writes it: its own $defs, referenced from the root
            "parameters": {
                "type": "object",
                "properties": {"unit": {"$ref": "#/$defs/Unit"}},
                "required": ["unit"],
                "$defs": {"Unit": {"enum": ["c", "f"]}},
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},
]
NAMED_PICK = {"type": "function", "function": {"name": "pick"}}
WEATHER_CALL = {"name": "get_weather", "parameters": {"city": "Paris"}}
PICK_CALL = {"name": "pick", "parameters": {"unit": "c"}}


def _validator(schema: dict) -> jsonschema.protocols.Validator:
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_required_schema_pairs_each_name_with_its_parameters():
    validator = _validator(forced_tool_calls_schema(TOOLS, "required", parallel_tool_calls=False))
    for good in ([WEATHER_CALL], [PICK_CALL], [{"name": "now", "parameters": {}}]):
        assert validator.is_valid(good), good
    for bad in (
        [],
        [WEATHER_CALL, PICK_CALL],  # parallel calls not allowed
        [{"name": "get_weather", "parameters": {"unit": "c"}}],  # another tool's parameters
        [{"name": "pick", "parameters": {"unit": "kelvin"}}],  # through the $ref
        [{"name": "get_weather", "parameters": {"city": 1}}],
        [{"name": "nope", "parameters": {}}],
        [{"name": "get_weather"}],
        [{**WEATHER_CALL, "extra": 1}],
        WEATHER_CALL,
    ):
        assert not validator.is_valid(bad), bad


def test_parallel_required_schema_allows_several_calls():
    validator = _validator(forced_tool_calls_schema(TOOLS, "required", parallel_tool_calls=True))
    assert validator.is_valid([WEATHER_CALL, PICK_CALL, WEATHER_CALL])
    assert not validator.is_valid([])


def test_named_schema_is_one_call_of_that_function():
    validator = _validator(forced_tool_calls_schema(TOOLS, NAMED_PICK, parallel_tool_calls=True))
    assert validator.is_valid(PICK_CALL)
    for bad in ([PICK_CALL], WEATHER_CALL, {"name": "pick", "parameters": {"unit": "x"}}):
        assert not validator.is_valid(bad), bad


def test_forced_schema_leaves_the_request_tools_unchanged():
    tools = copy.deepcopy(TOOLS)
    forced_tool_calls_schema(tools, "required", parallel_tool_calls=False)
    assert tools == TOOLS


def test_forced_output_parses_into_tool_calls():
    calls = parse_forced_tool_calls(json.dumps([WEATHER_CALL, PICK_CALL]), "required")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("pick", {"unit": "c"}),
    ]
    assert all(isinstance(c, ToolCall) and c.id.startswith("call_") for c in calls)
    [call] = parse_forced_tool_calls(json.dumps(PICK_CALL), NAMED_PICK)
    assert (call.name, call.arguments) == ("pick", '{"unit": "c"}')
    # Output cut short, or of the other shape: no calls, for the caller to send as content.
    assert parse_forced_tool_calls('[{"name": "pick", "parameters": {"un', "required") == []
    assert parse_forced_tool_calls(json.dumps(PICK_CALL), "required") == []
    assert parse_forced_tool_calls("[]", "required") == []
    assert parse_forced_tool_calls(json.dumps([PICK_CALL]), NAMED_PICK) == []


@pytest.mark.parametrize(
    "tools,tool_choice,param,message",
    [
        ([{"type": "function", "function": {}}], "required", "tools", r"tools\[0\]"),
        ([{"type": "function"}], "required", "tools", r"tools\[0\]"),
        (["get_weather"], "required", "tools", r"tools\[0\]"),
        ([{"type": "code_interpreter"}], "required", "tools", r"tools\[0\]"),
        ([TOOLS[0], TOOLS[0]], "required", "tools", r"'get_weather' is defined twice"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
            "required",
            "tools",
            "not a JSON schema",
        ),
        ([], "required", "tools", "at least one tool"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice", "'nope'"),
        (TOOLS, {"type": "function"}, "tool_choice", "does not force"),
        (TOOLS, "auto", "tool_choice", "does not force"),
    ],
)
def test_forced_schema_refuses_bad_tools_and_choices(tools, tool_choice, param, message):
    with pytest.raises(InvalidRequestError, match=message) as info:
        forced_tool_calls_schema(tools, tool_choice, parallel_tool_calls=False)
    assert info.value.param == param


def test_forced_schemas_compile_for_the_grammar_engine():
    xgrammar = pytest.importorskip("xgrammar")
    accepts = getattr(xgrammar.testing, "_is_grammar_accept_string", None)
    for tool_choice, good, bad in [
        ("required", [PICK_CALL], [{"name": "pick", "parameters": {"unit": "k"}}]),
        (NAMED_PICK, PICK_CALL, WEATHER_CALL),
    ]:
        schema = forced_tool_calls_schema(TOOLS, tool_choice, parallel_tool_calls=False)
        grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema))
        if accepts is not None:
            assert accepts(grammar, json.dumps(good))
            assert not accepts(grammar, json.dumps(bad))
