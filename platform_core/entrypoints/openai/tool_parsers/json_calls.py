"""Reading calls written as JSON objects ``{"name": ..., "arguments"|"parameters": {...}}``."""

from __future__ import annotations

import json

from platform_core.entrypoints.openai.tool_parsers.messages import ParsedCall


def call_from_json(text: str) -> ParsedCall | None:
    """The call the JSON ``text`` writes, or None when it is not one."""
    try:
        return call_from_object(json.loads(text))
    except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        return None


def call_from_object(obj: object) -> ParsedCall | None:
    """The call a decoded JSON value is, or None. ``parameters`` is accepted for
    ``arguments``, and arguments written as a JSON string holding an object are unwrapped."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    arguments_json = dump_arguments(arguments)
    return None if arguments_json is None else ParsedCall(obj["name"], arguments_json)


def dump_arguments(arguments: object) -> str | None:
    """``arguments`` as a JSON object string, or None when it is not a dict that strict JSON
    can write (a NaN, a set, bytes, ...)."""
    if not isinstance(arguments, dict):
        return None
    try:
        return json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None
