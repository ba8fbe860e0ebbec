"""Tool calling in the chat API: the tools a request offers, the ``tool_choice`` that forces
one, the calls of earlier assistant turns, and the calls of a reply, whole or streamed."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from platform_core.entrypoints.openai.request_base import RequestModel, Text


# ------------------------------------------------------------------------------------ requests
class CalledFunction(RequestModel):
    """The function an earlier assistant turn called: ``arguments`` is its JSON text."""

    name: Text
    arguments: Text


class MessageToolCall(RequestModel):
    """One tool call of an earlier assistant turn (``messages[i].tool_calls``)."""

    id: Text
    type: Literal["function"] = "function"
    function: CalledFunction


class FunctionDefinition(RequestModel):
    """A function the model may call; ``parameters`` is the JSON schema of its arguments."""

    name: Text
    description: Text | None = None
    parameters: dict[Text, Any] | None = None
    strict: bool | None = None


class ToolDefinition(RequestModel):
    """One entry of ``tools``: OpenAI's ``{"type": "function", "function": {...}}``."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(RequestModel):
    name: Text


class NamedToolChoice(RequestModel):
    """``tool_choice`` forcing one function: ``{"type": "function", "function": {"name"}}``."""

    type: Literal["function"]
    function: FunctionName


# ----------------------------------------------------------------------------------- responses
class FunctionCall(BaseModel):
    name: str
    arguments: str


class ChatToolCall(BaseModel):
    """A tool call of a reply; ``function.arguments`` is a JSON object's text."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCallItem(BaseModel):
    """A streamed piece of call ``index``: the first has ``id``, ``type`` and the name; the
    ``arguments`` pieces of an index concatenate to its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall
