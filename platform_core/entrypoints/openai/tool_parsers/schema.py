"""Forcing a tool call with a JSON schema (``tool_choice`` "required" or a named function), and
reading the calls back out of output constrained by it.

"required" gives an array of call objects (one, or at least one with ``parallel_tool_calls``);
a named function gives one call object, no array. A call object is
``{"name": <the function>, "parameters": <its arguments>}``, each name paired with its own
parameters schema. The parameters schemas are placed under the root ``$defs`` (one entry per
function) and their local ``$ref``s rewritten to match, so schemas with their own ``$defs``
(e.g. written by pydantic) keep resolving.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from platform_core.entrypoints.openai.tool_parsers.json_calls import call_from_object
from platform_core.entrypoints.openai.tool_parsers.messages import ToolCall, new_call_id
from platform_core.errors import InvalidRequestError

_NO_PARAMETERS = {"type": "object", "properties": {}}


def forced_tool_calls_schema(
    tools: list[dict], tool_choice: str | dict, parallel_tool_calls: bool
) -> dict:
    """The JSON schema the output must match so that it is the call(s) ``tool_choice`` forces.
    Raises InvalidRequestError for a tool without a function name, a repeated name, a choice
    that forces nothing, or a named function not in ``tools``."""
    functions = _function_parameters(tools)
    name = forced_function_name(tool_choice)
    if name is None:
        if not functions:
            raise InvalidRequestError("tool_choice 'required' needs at least one tool", "tools")
        array: dict[str, Any] = {
            "type": "array",
            "items": {"anyOf": [_call_schema(function) for function in functions]},
            "minItems": 1,
        }
        if not parallel_tool_calls:
            array["maxItems"] = 1
        return {**array, "$defs": {f: _relocate(p, f) for f, p in functions.items()}}
    if name not in functions:
        raise InvalidRequestError(
            f"tool_choice names function {name!r}, which is not among the tools "
            f"({', '.join(map(repr, functions)) or 'none'})",
            "tool_choice",
        )
    return {**_call_schema(name), "$defs": {name: _relocate(functions[name], name)}}


def parse_forced_tool_calls(text: str, tool_choice: str | dict) -> list[ToolCall]:
    """The calls in output constrained by :func:`forced_tool_calls_schema` (arguments: the
    ``parameters`` as JSON); [] when the text is not of that shape (e.g. cut short by
    ``max_tokens``), for the caller to treat as content."""
    named = forced_function_name(tool_choice) is not None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return []
    objects = [value] if named else value
    if not isinstance(objects, list):
        return []
    calls = [call for call in map(call_from_object, objects) if call is not None]
    if not objects or len(calls) != len(objects):
        return []
    return [ToolCall(new_call_id(), call.name, call.arguments) for call in calls]


def forced_function_name(tool_choice: str | dict) -> str | None:
    """The function a named ``tool_choice`` forces, None for "required"; InvalidRequestError
    for any other choice ("auto" and "none" force nothing)."""
    if tool_choice == "required":
        return None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return function["name"]
    raise InvalidRequestError(
        f"tool_choice {tool_choice!r} does not force a tool call: expected 'required' or "
        '{"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def _function_parameters(tools: list[dict]) -> dict[str, dict]:
    """Each tool's function name and parameters schema, in order; InvalidRequestError for a
    tool that is not a named function, or a name used twice."""
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        is_function = isinstance(tool, dict) and tool.get("type", "function") == "function"
        function = tool.get("function") if is_function else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"tools[{i}] is not a function with a name", "tools")
        if name in functions:
            raise InvalidRequestError(f"tools[{i}]: function {name!r} is defined twice", "tools")
        parameters = function.get("parameters", _NO_PARAMETERS)
        if not isinstance(parameters, dict):
            raise InvalidRequestError(
                f"tools[{i}]: the parameters of {name!r} are not a JSON schema object", "tools"
            )
        functions[name] = parameters
    return functions


def _call_schema(name: str) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "parameters": {"$ref": _pointer(name)}},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


def _pointer(name: str) -> str:
    """The reference to ``$defs/<name>`` (JSON-pointer escaped)."""
    return "#/$defs/" + name.replace("~", "~0").replace("/", "~1")


def _relocate(schema: dict, name: str) -> dict:
    """A copy of ``schema`` whose JSON-pointer references ("#", "#/...") still point into it
    once it sits at ``$defs/<name>`` of another document."""

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
                node["$ref"] = _pointer(name) + ref[1:]
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    relocated = copy.deepcopy(schema)
    visit(relocated)
    return relocated
