"""``serve --lora-modules``: the LoRA adapters a server starts with, in vLLM's two spellings.

Kept free of heavy imports: the ``serve`` parser reads its values with ``parse_lora_module``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

_JSON_KEYS = frozenset({"name", "path", "base_model_name"})


@dataclass(frozen=True, slots=True)
class LoRAModulePath:
    """One adapter to serve from start: requests name it ``name``; ``path`` is its PEFT
    directory; ``base_model_name`` is what ``/v1/models`` shows as its ``parent`` (default:
    the served model's name)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """``name=path``, or a JSON object ``{"name": ..., "path": ..., "base_model_name": ...}``
    (``base_model_name`` optional); ``argparse.ArgumentTypeError`` otherwise."""
    usage = "expected name=path or a JSON object with 'name' and 'path'"
    if text.lstrip().startswith("{"):
        try:
            fields = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"invalid JSON in {text!r}: {exc}") from None
        if not isinstance(fields, dict) or not set(fields) <= _JSON_KEYS:
            raise argparse.ArgumentTypeError(
                f"{usage} (and optionally 'base_model_name'), got {text!r}"
            )
        name, path, base = fields.get("name"), fields.get("path"), fields.get("base_model_name")
    else:
        name, _, path = text.partition("=")
        base = None
    if not (isinstance(name, str) and name.strip() and isinstance(path, str) and path.strip()):
        raise argparse.ArgumentTypeError(f"{usage}, got {text!r}")
    if base is not None and not (isinstance(base, str) and base.strip()):
        raise argparse.ArgumentTypeError(f"base_model_name must be a non-empty string in {text!r}")
    return LoRAModulePath(name.strip(), path.strip(), base)
