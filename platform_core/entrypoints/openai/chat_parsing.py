"""Splitting a chat reply into reasoning, content and tool calls, whole or streamed.

A request's :class:`ReplyFormat` says which stages apply: the reasoning parser
(``--reasoning-parser``, skipped when the chat template closed the reasoning in the prompt),
then, on the content only, one tool stage: none (``tool_choice`` "none"), the tool-call parser
(``--tool-call-parser`` with "auto"), or the call schema's reader ("required" or a named
function, whose output the engine constrains to that schema). Each choice gets its own
:class:`ReplyParser` (the parsers keep per-stream state). A whole reply goes through the same
streaming pipeline, fed at once, so whole and streamed replies agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from platform_core.entrypoints.openai.protocol import ChatCompletionRequest
from platform_core.entrypoints.openai.serving_base import ServingOptions
from platform_core.entrypoints.openai.tool_parsers import (
    DeltaToolCall,
    ToolParser,
    forced_tool_calls_schema,
    get_tool_parser,
    parse_forced_tool_calls,
)
from platform_core.entrypoints.openai.tool_protocol import (
    ChatToolCall,
    DeltaFunctionCall,
    DeltaToolCallItem,
    FunctionCall,
)
from platform_core.errors import ConfigError, InvalidRequestError
from platform_core.reasoning import ReasoningParser, get_reasoning_parser
from platform_core.structured_outputs_params import StructuredOutputsParams

ToolChoice = str | dict[str, Any]


@dataclass
class ReplyParts:
    """What (a piece of) a reply holds: reasoning, content and tool-call pieces."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def add(self, other: ReplyParts) -> ReplyParts:
        """Both pieces, in order, as one."""
        return ReplyParts(
            self.reasoning + other.reasoning,
            self.content + other.content,
            self.tool_calls + other.tool_calls,
        )


class _ToolStage(Protocol):
    """Reads tool calls out of the content of a reply, fed in pieces."""

    def feed(self, content: str) -> ReplyParts: ...

    def finish(self) -> ReplyParts: ...


class _NoTools:
    """``tool_choice`` "none": the content is the content."""

    def feed(self, content: str) -> ReplyParts:
        return ReplyParts(content=content)

    def finish(self) -> ReplyParts:
        return ReplyParts()


class _ParsedTools:
    """``tool_choice`` "auto": the tool-call parser finds the calls in the content."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._text = ""

    def feed(self, content: str) -> ReplyParts:
        if not content:
            return ReplyParts()
        previous, self._text = self._text, self._text + content
        return _from_stream_delta(
            self._parser.extract_tool_calls_streaming(previous, self._text, content)
        )

    def finish(self) -> ReplyParts:
        return _from_stream_delta(self._parser.finish(self._text))


class _ForcedTools:
    """A forced call: the content is the call schema's JSON, held until the reply ends; then
    its calls, or the text as content when it does not parse (cut short by ``max_tokens``)."""

    def __init__(self, tool_choice: ToolChoice) -> None:
        self._tool_choice = tool_choice
        self._text = ""

    def feed(self, content: str) -> ReplyParts:
        self._text += content
        return ReplyParts()

    def finish(self) -> ReplyParts:
        calls = parse_forced_tool_calls(self._text, self._tool_choice)
        if not calls:
            return ReplyParts(content=self._text)
        deltas = [DeltaToolCall(i, c.id, c.name, c.arguments) for i, c in enumerate(calls)]
        return ReplyParts(tool_calls=deltas)


def _from_stream_delta(delta: Any) -> ReplyParts:
    """A tool parser's ``StreamDelta`` (or None) as reply parts."""
    if delta is None:
        return ReplyParts()
    return ReplyParts(content=delta.content or "", tool_calls=list(delta.tool_calls))


class ReplyParser:
    """One choice's reply, fed its text in pieces: reasoning first (when a parser is given),
    then the tool stage on the content."""

    def __init__(self, reasoning: ReasoningParser | None, tools: _ToolStage) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._text = ""
        self.called_tools = False

    def feed(self, text: str) -> ReplyParts:
        """The parts that ``text`` (the reply's next piece) makes ready."""
        if self._reasoning is None:
            return self._content(text)
        previous, self._text = self._text, self._text + text
        split = self._reasoning.extract_reasoning_streaming(previous, text)
        if split is None:
            return ReplyParts()
        return ReplyParts(reasoning=split.reasoning or "").add(self._content(split.content or ""))

    def finish(self) -> ReplyParts:
        """What was held back, once the reply has ended."""
        parts = ReplyParts()
        if self._reasoning is not None and (split := self._reasoning.finish(self._text)):
            parts = ReplyParts(reasoning=split.reasoning or "").add(
                self._content(split.content or "")
            )
        end = self._tools.finish()
        self.called_tools = self.called_tools or bool(end.tool_calls)
        return parts.add(end)

    def parse(self, text: str) -> ReplyParts:
        """The parts of a whole reply."""
        return self.feed(text).add(self.finish())

    def finish_reason(self, reason: str | None) -> str | None:
        """``tool_calls`` once the reply called a tool, else the engine's reason."""
        return "tool_calls" if self.called_tools and reason is not None else reason

    def _content(self, content: str) -> ReplyParts:
        parts = self._tools.feed(content)
        self.called_tools = self.called_tools or bool(parts.tool_calls)
        return parts


@dataclass(frozen=True)
class ReplyFormat:
    """How a request's replies are parsed: ``parsing`` is false when they are plain text
    (content never null); ``constraint`` is the forced call schema the engine must apply."""

    reasoning: type[ReasoningParser] | None
    tool_parser: type[ToolParser] | None
    tool_choice: ToolChoice
    constraint: StructuredOutputsParams | None

    @property
    def parsing(self) -> bool:
        return self.reasoning is not None or self.tool_choice != "none"

    def new_parser(self, tokenizer: Any) -> ReplyParser:
        """A parser for one choice's reply."""
        reasoning = None if self.reasoning is None else self.reasoning(tokenizer)
        return ReplyParser(reasoning, self._tool_stage(tokenizer))

    def _tool_stage(self, tokenizer: Any) -> _ToolStage:
        if self.tool_choice == "none":
            return _NoTools()
        if self.tool_choice == "auto":
            assert self.tool_parser is not None  # resolve_tool_choice allows auto only with one
            return _ParsedTools(self.tool_parser(tokenizer))
        return _ForcedTools(self.tool_choice)


@dataclass(frozen=True)
class ChatParsers:
    """The server's parser classes (``--reasoning-parser``, ``--tool-call-parser``) and whether
    ``tool_choice`` may be "auto"; an unknown name fails when the server is built."""

    reasoning: type[ReasoningParser] | None
    tool_parser: type[ToolParser] | None
    auto_tool_choice: bool

    @classmethod
    def from_options(cls, options: ServingOptions) -> ChatParsers:
        if options.enable_auto_tool_choice and options.tool_call_parser is None:
            raise ConfigError("enable_auto_tool_choice needs tool_call_parser (the call format)")
        reasoning = options.reasoning_parser
        tools = options.tool_call_parser
        return cls(
            None if reasoning is None else get_reasoning_parser(reasoning),
            None if tools is None else get_tool_parser(tools),
            options.enable_auto_tool_choice,
        )

    def reply_format(
        self, body: ChatCompletionRequest, prompt_ids: list[int], tokenizer: Any
    ) -> ReplyFormat:
        """How ``body``'s replies are parsed (``prompt_ids``: its rendered prompt).

        Raises InvalidRequestError for a tool choice the server or the tools do not allow.
        """
        reasoning = self.reasoning
        if reasoning is not None and reasoning(tokenizer).reasoning_ended_in_prompt(prompt_ids):
            reasoning = None
        tool_choice = self.resolve_tool_choice(body)
        constraint = None
        if tool_choice not in ("none", "auto"):
            constraint = _forced_constraint(body, tool_choice)
        return ReplyFormat(reasoning, self.tool_parser, tool_choice, constraint)

    def resolve_tool_choice(self, body: ChatCompletionRequest) -> ToolChoice:
        """``body.tool_choice`` as "none", "auto", "required" or the named-function dict; its
        default is "auto" when tools are given and the server enables it, else "none"."""
        choice = body.tool_choice
        if choice is None:
            return "auto" if body.tools and self.auto_tool_choice else "none"
        if choice == "auto" and not self.auto_tool_choice:
            raise InvalidRequestError(
                'tool_choice "auto" needs a server started with --enable-auto-tool-choice and '
                "--tool-call-parser",
                "tool_choice",
            )
        if choice != "none" and not body.tools:
            raise InvalidRequestError(f"tool_choice {choice!r} needs tools", "tool_choice")
        return choice if isinstance(choice, str) else choice.model_dump(exclude_unset=True)


def _forced_constraint(
    body: ChatCompletionRequest, tool_choice: ToolChoice
) -> StructuredOutputsParams:
    """The call schema as the request's one output constraint; InvalidRequestError when the
    request constrains its output otherwise too."""
    if body.structured_outputs_params() is not None:
        raise InvalidRequestError(
            f"tool_choice {tool_choice!r} constrains the output to tool calls; it cannot be "
            "combined with another output constraint (response_format, structured_outputs, "
            "guided_*)",
            "tool_choice",
        )
    if body.use_beam_search:
        raise InvalidRequestError("beam search cannot force a tool call", "use_beam_search")
    parallel = body.parallel_tool_calls is not False
    schema = forced_tool_calls_schema(body.tool_dicts(), tool_choice, parallel)
    return StructuredOutputsParams(json=schema)


def tool_call_items(calls: list[DeltaToolCall]) -> list[DeltaToolCallItem] | None:
    """Streamed call pieces in OpenAI's chunk shape (None when there are none)."""
    if not calls:
        return None
    return [
        DeltaToolCallItem(
            index=call.index,
            id=call.id,
            type="function" if call.id is not None else None,
            function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
        )
        for call in calls
    ]


def whole_tool_calls(calls: list[DeltaToolCall]) -> list[ChatToolCall] | None:
    """A whole reply's call pieces merged per call (None when there are none)."""
    merged: dict[int, ChatToolCall] = {}
    for call in calls:
        entry = merged.get(call.index)
        if entry is None:
            function = FunctionCall(name=call.name or "", arguments="")
            entry = merged[call.index] = ChatToolCall(id=call.id or "", function=function)
        entry.function.arguments += call.arguments or ""
    return [merged[i] for i in sorted(merged)] or None
