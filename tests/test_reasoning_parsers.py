"""Reasoning parsers: whole-output and streamed splits, token-level content start, registry."""

from __future__ import annotations

import copy
import importlib.metadata
import random
import sys
import types
from importlib.metadata import EntryPoint

import pytest
from tiny_tokenizer import save_tiny_tokenizer

from platform_core.errors import ConfigError
from platform_core.reasoning import (
    ENTRY_POINT_GROUP,
    ReasoningDelta,
    ReasoningParser,
    UnknownParserError,
    get_reasoning_parser,
    reasoning_parser_names,
    register_reasoning_parser,
)
from platform_core.reasoning import registry as reasoning_registry

# (output, deepseek_r1 split, qwen3 split)
CASES = [
    (
        "<think>\nLet me see.\n</think>\n\nParis.",
        ("Let me see.", "Paris."),
        ("Let me see.", "Paris."),
    ),
    (
        "Let me see.\n</think>\n\nParis.",
        ("Let me see.", "Paris."),
        (None, "Let me see.\n</think>\n\nParis."),
    ),
    ("<think>\n\n</think>\n\nParis.", (None, "Paris."), (None, "Paris.")),
    ("Paris.", ("Paris.", None), (None, "Paris.")),
    ("<think>\nstill going", ("still going", None), ("still going", None)),
    ("<think>a</think>", ("a", None), ("a", None)),
    ("  <think>a\n\n</think>b</think>c", ("a\n", "b</think>c"), ("a\n", "b</think>c")),
    ("x <think>y</think>z", ("x <think>y", "z"), (None, "x <think>y</think>z")),
    (
        "<think>a < b </thinking> </thin</think>ok",
        ("a < b </thinking> </thin", "ok"),
        ("a < b </thinking> </thin", "ok"),
    ),
    ("<think>cut at </th", ("cut at </th", None), ("cut at </th", None)),
    ("<thi", ("<thi", None), (None, "<thi")),
    ("", (None, None), (None, None)),
    ("\n", ("\n", None), (None, "\n")),
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """The tiny BPE tokenizer, with and without <think> / </think> as special tokens."""
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(directory)
    special = AutoTokenizer.from_pretrained(directory)
    special.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    return {"special": special, "plain": AutoTokenizer.from_pretrained(directory)}


def _parser(name: str, tokenizer=None) -> ReasoningParser:
    return get_reasoning_parser(name)(tokenizer)


def _stream(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str, list[ReasoningDelta]]:
    """Feed ``pieces`` to a streaming parse; the joined reasoning, content and every delta."""
    deltas, text = [], ""
    for piece in pieces:
        deltas.append(parser.extract_reasoning_streaming(text, piece))
        text += piece
    deltas.append(parser.finish(text))
    sent = [d for d in deltas if d is not None]
    for delta in sent:
        assert delta.reasoning or delta.content, "a delta carries something, or is None"
        assert delta.reasoning != "" and delta.content != ""
    return "".join(d.reasoning or "" for d in sent), "".join(d.content or "" for d in sent), sent


def _splits(text: str, seed: int = 0):
    """Every fixed piece size, then random cuts."""
    for size in range(1, len(text) + 1):
        yield [text[i : i + size] for i in range(0, len(text), size)]
    rng = random.Random(seed)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("output,deepseek,qwen3", CASES)
def test_whole_output_split(output, deepseek, qwen3):
    assert _parser("deepseek_r1").extract_reasoning(output) == deepseek
    assert _parser("qwen3").extract_reasoning(output) == qwen3


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("output", [case[0] for case in CASES if case[0]])
def test_streamed_split_equals_whole_output_at_every_cut(name, output):
    reasoning, content = _parser(name).extract_reasoning(output)
    for pieces in _splits(output):
        parser = _parser(name)
        assert _stream(parser, pieces)[:2] == (reasoning or "", content or ""), pieces


def test_only_a_possible_tag_is_held_back():
    parser = _parser("deepseek_r1")
    assert parser.extract_reasoning_streaming("", "<think>\nabc </th") == ReasoningDelta(
        "abc ", None
    )
    assert parser.extract_reasoning_streaming("<think>\nabc </th", "ink>\n\nP") == ReasoningDelta(
        None, "P"
    )
    parser = _parser("deepseek_r1")
    assert parser.extract_reasoning_streaming("", "a </b> 1 < 2\n") == ReasoningDelta(
        "a </b> 1 < 2", None
    )
    # The held newline is reasoning once the next piece is not the closing tag.
    assert parser.extract_reasoning_streaming("a </b> 1 < 2\n", "x") == ReasoningDelta("\nx", None)
    parser = _parser("qwen3")
    assert parser.extract_reasoning_streaming("", "<thi") is None
    assert parser.extract_reasoning_streaming("<thi", "s is it") == ReasoningDelta(
        None, "<this is it"
    )


def test_finish_sends_held_text_to_its_channel():
    parser = _parser("deepseek_r1")
    assert parser.extract_reasoning_streaming("", "<think>a\n</thi") == ReasoningDelta("a", None)
    assert parser.finish("<think>a\n</thi") == ReasoningDelta("\n</thi", None)
    parser = _parser("qwen3")
    assert parser.extract_reasoning_streaming("", " <th") is None
    assert parser.finish(" <th") == ReasoningDelta(None, " <th")
    # finish sends only the tail the deltas of that text held back, on any instance.
    assert _parser("qwen3").finish("<think>done</th") == ReasoningDelta("</th", None)
    assert _parser("qwen3").finish("<think>done</think>") is None


def test_an_instance_shared_by_interleaved_streams_still_answers_right():
    parser = _parser("qwen3")
    assert parser.extract_reasoning_streaming("", "<think>\nA") == ReasoningDelta("A", None)
    assert parser.extract_reasoning_streaming("", "plain") == ReasoningDelta(None, "plain")
    assert parser.extract_reasoning_streaming("<think>\nA", "</think>B") == ReasoningDelta(
        None, "B"
    )
    assert parser.extract_reasoning_streaming("plain", " text") == ReasoningDelta(None, " text")


def test_end_token_ids_single_special_token_or_encoding(tokenizers):
    special, plain = tokenizers["special"], tokenizers["plain"]
    assert _parser("qwen3", special).end_token_ids == (special.convert_tokens_to_ids("</think>"),)
    ids = _parser("qwen3", plain).end_token_ids
    assert len(ids) > 1 and ids == tuple(plain.encode("</think>", add_special_tokens=False))


@pytest.mark.parametrize("kind", ["special", "plain"])
def test_content_start_in_tokens(tokenizers, kind):
    tokenizer = tokenizers[kind]
    parser = _parser("deepseek_r1", tokenizer)
    reasoning = tokenizer.encode("<think>\nThe capital of France", add_special_tokens=False)
    content = tokenizer.encode("Paris.", add_special_tokens=False)
    end = list(parser.end_token_ids)
    ids = reasoning + end + content + end + content  # only the first closing tag counts
    expected = len(reasoning) + len(end)
    if kind == "special":
        whole = "<think>\nThe capital of France</think>Paris."
        assert tokenizer.encode(whole, add_special_tokens=False) == ids[: expected + len(content)]
    assert parser.content_start(ids) == expected
    assert parser.content_start(tuple(ids)) == expected
    for k in range(expected):
        assert parser.content_start(ids[:k]) is None
    # Polling a growing output: resuming after any cut that had not seen the whole tag works.
    for searched in range(expected):
        assert parser.content_start(ids, searched=searched) == expected
    # A resumed search does not look back before what it is told was searched.
    assert parser.content_start(ids, searched=len(ids)) is None


def test_content_start_polled_token_by_token(tokenizers):
    parser = _parser("qwen3", tokenizers["plain"])
    tokenizer = tokenizers["plain"]
    ids = tokenizer.encode("<think>\nhmm", add_special_tokens=False)
    ids += [*parser.end_token_ids, *tokenizer.encode("ok", add_special_tokens=False)]
    searched, found = 0, None
    for n in range(1, len(ids) + 1):
        found = parser.content_start(ids[:n], searched)
        if found is not None:
            break
        searched = n
    assert found == len(ids) - len(tokenizer.encode("ok", add_special_tokens=False))


@pytest.mark.parametrize("kind", ["special", "plain"])
def test_reasoning_ended_in_prompt(tokenizers, kind):
    tokenizer = tokenizers[kind]
    parser = _parser("qwen3", tokenizer)
    end = list(parser.end_token_ids)

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    no_thinking = encode("user: hi\nassistant: <think>\n\n") + end + encode("\n\n")
    assert parser.reasoning_ended_in_prompt(no_thinking)
    earlier_turn = encode("assistant: <think>a") + end + encode("b\nuser: again\nassistant:")
    assert not parser.reasoning_ended_in_prompt(earlier_turn)
    assert not parser.reasoning_ended_in_prompt(encode("user: hi\nassistant: <think>\n"))


def test_registry_names_and_unknown_name_error():
    assert {"deepseek_r1", "qwen3"} <= set(reasoning_parser_names())
    with pytest.raises(UnknownParserError, match="unknown reasoning parser 'nope'") as info:
        get_reasoning_parser("nope")
    assert isinstance(info.value, ConfigError)
    assert "deepseek_r1" in str(info.value) and "qwen3" in info.value.known


def test_register_refuses_a_taken_name_and_a_non_parser():
    with pytest.raises(ConfigError, match="already registered"):
        register_reasoning_parser("qwen3")(type("Other", (ReasoningParser,), {}))
    with pytest.raises(ConfigError, match="not a ReasoningParser subclass"):
        register_reasoning_parser("not-a-parser")(object)  # type: ignore[arg-type]


class BracketThinker(ReasoningParser):
    """A third-party parser: another tag pair, reasoning from the start."""

    start_tag = "[think]"
    end_tag = "[/think]"
    starts_in_reasoning = True


@pytest.fixture
def plugins(monkeypatch):
    """Entry points of the reasoning group: a fake plugin module, a missing module, a non-parser."""
    module = types.ModuleType("fake_reasoning_plugin")
    module.BracketThinker = BracketThinker
    module.NotAParser = dict
    monkeypatch.setitem(sys.modules, "fake_reasoning_plugin", module)
    eps = [
        EntryPoint("brackets", "fake_reasoning_plugin:BracketThinker", ENTRY_POINT_GROUP),
        EntryPoint("missing", "no_such_module_for_tests:Parser", ENTRY_POINT_GROUP),
        EntryPoint("wrong", "fake_reasoning_plugin:NotAParser", ENTRY_POINT_GROUP),
        EntryPoint("qwen3", "fake_reasoning_plugin:BracketThinker", ENTRY_POINT_GROUP),
    ]
    real = importlib.metadata.entry_points
    calls = []

    def entry_points(**params):
        calls.append(params)
        return eps if params.get("group") == ENTRY_POINT_GROUP else real(**params)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    # A registry that has not looked at entry points yet, with the built-ins registered.
    fresh = copy.deepcopy(reasoning_registry._REGISTRY)
    fresh._plugins_loaded = False
    monkeypatch.setattr(reasoning_registry, "_REGISTRY", fresh)
    return calls


def test_third_party_parser_through_an_entry_point(plugins, caplog):
    assert get_reasoning_parser("qwen3").__name__ == "Qwen3ReasoningParser"
    assert plugins == [], "a built-in name loads no plugin"
    cls = get_reasoning_parser("brackets")
    assert cls is BracketThinker
    assert cls(None).extract_reasoning("hm[/think] ok") == ("hm", "ok")
    # A plugin cannot take a built-in's name; broken ones are left out of the names...
    assert get_reasoning_parser("qwen3").__name__ == "Qwen3ReasoningParser"
    assert set(reasoning_parser_names()) == {"brackets", "deepseek_r1", "qwen3"}
    assert "failed to load" in caplog.text and "name is taken" in caplog.text
    # ... and looking one up names its failure.
    with pytest.raises(ConfigError, match=r"'missing' failed to load.*no_such_module_for_tests"):
        get_reasoning_parser("missing")
    with pytest.raises(ConfigError, match=r"'wrong' failed to load.*not a ReasoningParser"):
        get_reasoning_parser("wrong")
    assert len(plugins) == 1, "entry points are read once"
