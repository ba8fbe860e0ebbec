"""The built-in reasoning parsers."""

from __future__ import annotations

from platform_core.reasoning.base import ReasoningParser
from platform_core.reasoning.registry import register_reasoning_parser


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 and models whose chat template opens the thinking block in the prompt
    (e.g. Qwen3 ``-Thinking-2507``): the output is reasoning until ``</think>``, with or
    without a leading ``<think>``; without ``</think>`` (cut short) it is all reasoning."""

    starts_in_reasoning = True


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 (and QwQ-style models) that write ``<think>`` themselves: reasoning only when the
    output opens with ``<think>``; otherwise it is all content. The empty block written with
    ``enable_thinking=False`` gives no reasoning. (When the template put the whole block in the
    prompt, see :meth:`ReasoningParser.reasoning_ended_in_prompt`.)"""
