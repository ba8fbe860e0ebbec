"""Incremental detokenization equals decoding the whole sequence, one token at a time."""

from __future__ import annotations

import pytest
from tiny_tokenizer import CORPUS, save_tiny_tokenizer

from platform_core.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("text", [*CORPUS[:4], "  spaces  and\nnewlines\t", "🚀🚀 ✨x"])
def test_token_by_token_equals_full_decode(tokenizer, text):
    prompt = tokenizer.encode("Prompt: ")
    output = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True)
    pieces = [detok.add([token]) for token in output]
    assert "".join(pieces) == detok.text == tokenizer.decode(output)
    assert all("\ufffd" not in piece for piece in pieces)


def test_special_tokens_skipped_or_kept(tokenizer):
    ids = [*tokenizer.encode("hi"), tokenizer.eos_token_id]
    skip = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    keep = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    for token in ids:
        skip.add([token])
        keep.add([token])
    assert skip.text == "hi"
    assert keep.text == "hi</s>"
