"""What a request's output must match: one JSON schema, regex, choice, grammar or structural tag."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from platform_core.errors import InvalidRequestError

PARAM = "structured_outputs"  # the name bad input is reported under

# The constraint kinds, in the order ``kind`` reports them.
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(slots=True)
class StructuredOutputsParams:
    """Exactly one constraint on a request's output (vLLM's ``StructuredOutputsParams``).

    - ``json``: a JSON schema (a dict, or its text); the output is one JSON value matching it.
    - ``regex``: the output matches the regular expression as a whole.
    - ``choice``: the output is exactly one of these strings.
    - ``grammar``: an EBNF grammar (GBNF style, ``root ::= ...``; the Lark dialect where the
      grammar engine takes it).
    - ``json_object``: any JSON object (OpenAI's ``response_format: {"type": "json_object"}``).
    - ``structural_tag``: xgrammar's structural tag (a dict, or its JSON text): free text with
      constrained segments between begin and end tags.

    ``disable_any_whitespace`` makes JSON compact (no optional whitespace between tokens), which
    also stops a model from padding an answer with endless spaces.

    The instance is normalized on construction: ``json`` and ``structural_tag`` given as text
    are parsed, so two requests with the same schema share one compiled grammar (``key``).
    """

    json: dict[str, Any] | bool | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_any_whitespace: bool = False
    key: tuple[str, str, bool] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("json_object", "disable_any_whitespace"):
            if getattr(self, name) not in (None, True, False):
                raise InvalidRequestError(f"{PARAM}.{name} must be a boolean", PARAM)
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            found = ", ".join(given) or "none"
            raise InvalidRequestError(
                f"exactly one of {', '.join(KINDS)} must be set in {PARAM}; got {found}", PARAM
            )
        if self.json is not None:
            self.json = _parse_json(self.json, "json", (dict, bool))
        if self.structural_tag is not None:
            self.structural_tag = _parse_json(self.structural_tag, "structural_tag", (dict,))
        if self.choice is not None:
            if (
                not isinstance(self.choice, list)
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise InvalidRequestError(
                    f"{PARAM}.choice must be a non-empty list of non-empty strings", PARAM
                )
            self.choice = list(dict.fromkeys(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{PARAM}.{name} must be a non-empty string", PARAM)
        kind = given[0]
        self.key = (kind, _canonical(getattr(self, kind)), bool(self.disable_any_whitespace))

    @property
    def kind(self) -> str:
        """Which constraint this is (one of ``KINDS``)."""
        return self.key[0]

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> StructuredOutputsParams:
        """Build from a request body's mapping; an unknown key is an ``InvalidRequestError``."""
        if not isinstance(values, dict):
            raise InvalidRequestError(f"{PARAM} must be an object", PARAM)
        known = {*KINDS, "disable_any_whitespace"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidRequestError(
                f"unknown {PARAM} field(s) {unknown}; known: {sorted(known)}", PARAM
            )
        return cls(**values)


def _parse_json(value: Any, name: str, types: tuple[type, ...]) -> Any:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{PARAM}.{name} is not valid JSON: {exc}", PARAM) from None
    if not isinstance(value, types):
        raise InvalidRequestError(
            f"{PARAM}.{name} must be a JSON object, got {type(value).__name__}", PARAM
        )
    return value


def _canonical(value: Any) -> str:
    """One text per value: sorted keys for JSON, the string itself for text constraints."""
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)
