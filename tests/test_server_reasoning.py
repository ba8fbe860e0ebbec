"""Reasoning output through the chat route (``--reasoning-parser``), whole and streamed.

On the shared tiny engine a choice constraint fixes the output, so the split is known: the
server's parsing is what is tested. With ``qwen3`` and a chat template that closes the thinking
block in the prompt (``enable_thinking=False`` style), an engine of its own (the engine must know
the parser: a constraint applies once the reasoning ended) checks that the reasoning is skipped
and the constraint applies from the first token.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from engine_probe import EngineProbe
from server_utils import (
    MODEL_NAME,
    assert_engine_clean,
    engine_config,
    live_server,
    start_test_engine,
)
from text_model import CHATML_TEMPLATE

HI = [{"role": "user", "content": "hi"}]
NO_THINKING_TEMPLATE = CHATML_TEMPLATE.replace(
    "<s>assistant\n{% endif %}", "<s>assistant\n<think>\n\n</think>\n\n{% endif %}"
)


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def deepseek(engine: Any) -> Iterator[openai.OpenAI]:
    """A client of a server on the shared tiny engine that parses ``deepseek_r1`` reasoning."""
    with live_server(engine, reasoning_parser="deepseek_r1") as url:
        yield client_of(url)


def reply(client: openai.OpenAI, stream: bool, choice: list[str], **kwargs: Any) -> tuple:
    """``(reasoning_content, content, finish_reason)`` of a one-choice reply, the deltas of a
    stream concatenated (None where nothing came)."""
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=HI,
        max_tokens=40,
        stream=stream,
        extra_body={"structured_outputs": {"choice": choice}},
        **kwargs,
    )
    if not stream:
        choice_ = response.choices[0]
        message = choice_.message
        return message.reasoning_content, message.content, choice_.finish_reason
    reasoning, content, finish = None, None, None
    for chunk in response:
        for c in chunk.choices:
            if c.delta.reasoning_content:
                reasoning = (reasoning or "") + c.delta.reasoning_content
            if c.delta.content:
                content = (content or "") + c.delta.content
            finish = c.finish_reason or finish
    return reasoning, content, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_output_without_an_end_tag_is_all_reasoning(deepseek, stream):
    assert reply(deepseek, stream, ["mulling it over"]) == ("mulling it over", None, "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_reasoning_and_content_split_at_the_end_tag(deepseek, stream):
    output = "<think>step one</think>\n\nthe answer"
    assert reply(deepseek, stream, [output]) == ("step one", "the answer", "stop")


def test_without_a_reasoning_parser_the_tags_are_content(base_url):
    output = "<think>step one</think>the answer"
    assert reply(client_of(base_url), False, [output]) == (None, output, "stop")


# ------------------------------------------- qwen3: the template closes the reasoning in the prompt
@pytest.fixture(scope="module")
def no_thinking_dir(text_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the tiny model whose generation prompt ends with an empty thinking block."""
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("no-thinking")
    shutil.copytree(text_model_dir, directory, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = NO_THINKING_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def qwen3(no_thinking_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A client of a server and engine on that copy, both with the ``qwen3`` parser."""
    probe = EngineProbe(tmp_path_factory.mktemp("probe"))
    config = engine_config(no_thinking_dir, reasoning_parser="qwen3")
    engine = start_test_engine(config, probe)
    try:
        with live_server(engine, reasoning_parser="qwen3") as url:
            yield client_of(url)
        assert_engine_clean(engine, probe)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_reasoning_closed_in_the_prompt_leaves_all_content_constrained(qwen3, stream):
    reasoning, content, finish_reason = reply(qwen3, stream, ["alpha", "beta"], temperature=0)
    assert reasoning is None
    assert content in ("alpha", "beta") and finish_reason == "stop"


def test_think_tags_after_a_closed_block_are_content(qwen3):
    output = "<think>a</think>b"
    assert reply(qwen3, False, [output]) == (None, output, "stop")
