"""Benchmark workloads: seeded random and shared-prefix requests, length ranges, token spaces and
JSONL files with errors that name the line."""

from __future__ import annotations

import pytest

from platform_core.bench.workloads import (
    LengthRange,
    TokenSpace,
    WorkloadError,
    load_jsonl,
    random_requests,
    shared_prefix_requests,
)


# ---------------------------------------------------------------------------- workloads
def test_random_requests_are_seeded_and_within_ranges():
    space = TokenSpace(10, 60, frozenset({20, 21}))
    a = random_requests(50, LengthRange(3, 9), LengthRange(2, 5), space, seed=7)
    assert a == random_requests(50, LengthRange(3, 9), LengthRange(2, 5), space, seed=7)
    assert a != random_requests(50, LengthRange(3, 9), LengthRange(2, 5), space, seed=8)
    lengths = {r.prompt_len for r in a}
    assert lengths <= set(range(3, 10)) and len(lengths) > 3
    assert {r.max_tokens for r in a} <= set(range(2, 6))
    ids = {t for r in a for t in r.prompt_token_ids}
    assert ids <= set(range(10, 60)) - {20, 21}


def test_token_space_from_tokenizer_drops_special_and_padded_ids():
    tokenizer = type("Tok", (), {"all_special_ids": [0, 1, 2], "__len__": lambda self: 40})()
    space = TokenSpace.from_tokenizer(tokenizer, vocab_size=64)
    assert space.candidates() == list(range(3, 40))
    assert TokenSpace.from_tokenizer(None, 8).candidates() == list(range(8))


def test_shared_prefix_is_shared_and_suffixes_unique():
    space = TokenSpace(0, 1000)
    requests = shared_prefix_requests(20, 12, 3, LengthRange(5, 5), space, seed=1)
    prefix = requests[0].prompt_token_ids[:12]
    assert all(r.prompt_token_ids[:12] == prefix and r.prompt_len == 15 for r in requests)
    assert len({tuple(r.prompt_token_ids[12:]) for r in requests}) == 20
    assert {r.max_tokens for r in requests} == {5}
    # Two token ids cannot make three distinct one-token suffixes.
    with pytest.raises(WorkloadError, match="unique"):
        shared_prefix_requests(3, 4, 1, LengthRange(1, 1), TokenSpace(0, 2))


@pytest.mark.parametrize("text", ["x", "9:3", "0", "1:b"])
def test_length_range_rejects_bad_text(text):
    with pytest.raises(WorkloadError):
        LengthRange.parse(text)


def test_length_range_and_token_space_parse():
    assert LengthRange.parse("7") == LengthRange(7, 7)
    assert LengthRange.parse("3:9") == LengthRange(3, 9)
    assert TokenSpace.parse("5:9").candidates() == [5, 6, 7, 8]
    with pytest.raises(WorkloadError):
        TokenSpace.parse("12")
    with pytest.raises(WorkloadError, match="no token ids"):
        TokenSpace(4, 4).candidates()


def test_jsonl_parsing(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(
        '{"prompt_token_ids": [5, 6, 7], "max_tokens": 4}\n'
        "\n"
        '{"prompt": "hello there", "max_tokens": 2, "comment": "ignored"}\n'
    )
    first, second = load_jsonl(path)
    assert (first.prompt_token_ids, first.max_tokens, first.prompt) == ([5, 6, 7], 4, None)
    assert first.as_prompt() == {"prompt_token_ids": [5, 6, 7]}
    assert (second.prompt, second.max_tokens, second.prompt_len) == ("hello there", 2, None)
    assert second.as_prompt() == "hello there"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "Expecting value"),
        ('{"max_tokens": 3}', "'prompt_token_ids' or 'prompt'"),
        ('{"prompt": "hi"}', "max_tokens"),
        ('{"prompt": "hi", "max_tokens": 0}', "max_tokens"),
        ('{"prompt_token_ids": [1, -2], "max_tokens": 3}', "non-negative"),
        ('{"prompt_token_ids": [], "max_tokens": 3}', "non-empty list"),
        ('{"prompt": "", "max_tokens": 3}', "non-empty string"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path, line, message):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "ok", "max_tokens": 1}\n' + line + "\n")
    with pytest.raises(WorkloadError, match=r"w\.jsonl:2") as info:
        load_jsonl(path)
    assert message in str(info.value)


def test_jsonl_without_requests_is_an_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(WorkloadError, match="no requests"):
        load_jsonl(path)
