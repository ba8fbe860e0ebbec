"""The request fields that constrain the output: OpenAI's ``response_format``, vLLM's
``structured_outputs`` and its older ``guided_*`` fields, and the one ``StructuredOutputsParams``
they come to (``output_constraint``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field

from platform_core.entrypoints.openai.request_base import RequestModel, Text
from platform_core.errors import InvalidRequestError
from platform_core.structured_outputs_params import KINDS, StructuredOutputsParams


class JsonSchemaSpec(RequestModel):
    """``response_format.json_schema``: a named JSON schema the output must match.

    ``strict`` is accepted for OpenAI's clients; the schema is always enforced exactly.
    """

    name: Text
    description: Text | None = None
    schema_: dict[Text, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TagStructure(RequestModel):
    """One tagged segment of vLLM's structural tag: text between ``begin`` and ``end`` is JSON
    matching ``schema``."""

    begin: Text
    schema_: dict[Text, Any] = Field(alias="schema")
    end: Text


# The fields each ``response_format`` type takes besides ``type``.
_FORMAT_FIELDS: dict[str, tuple[str, ...]] = {
    "text": (),
    "json_object": (),
    "json_schema": ("json_schema",),
    "structural_tag": ("structures", "triggers", "format"),
}


class ResponseFormat(RequestModel):
    """OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``), plus vLLM's
    ``structural_tag``: either ``structures`` with ``triggers`` (vLLM's form) or ``format``
    (xgrammar's structural tag), handed to the grammar engine as they are."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaSpec | None = None
    structures: list[TagStructure] | None = None
    triggers: list[Text] | None = None
    format: dict[Text, Any] | None = None

    def constraint(self) -> dict[str, Any] | None:
        """The ``StructuredOutputsParams`` field this format sets, as ``{kind: value}``;
        ``None`` for ``text``. Raises ``InvalidRequestError`` for a field the type lacks or
        does not take."""
        for name in type(self).model_fields:
            if getattr(self, name) is not None and name not in ("type", *_FORMAT_FIELDS[self.type]):
                raise InvalidRequestError(
                    f"response_format.{name} does not apply to type {self.type!r}",
                    f"response_format.{name}",
                )
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.schema_ is None:
                raise InvalidRequestError(
                    "response_format of type 'json_schema' needs json_schema.schema, the JSON "
                    "schema the output must match",
                    "response_format.json_schema.schema",
                )
            return {"json": self.json_schema.schema_}
        if self.type == "structural_tag":
            if (self.format is None) == (self.structures is None or self.triggers is None):
                raise InvalidRequestError(
                    "response_format of type 'structural_tag' needs either format (xgrammar's "
                    "structural tag) or structures with triggers (vLLM's)",
                    "response_format",
                )
            tag = self.model_dump(
                by_alias=True, exclude_none=True, include=set(type(self).model_fields)
            )
            return {"structural_tag": tag}
        return None


# vLLM's older per-field constraints -> the ``StructuredOutputsParams`` field each sets.
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
# vLLM's older per-request options, refused: ignoring one would silently change the output.
_REFUSED = {
    "guided_whitespace_pattern": "use structured_outputs.disable_any_whitespace for compact JSON",
    "guided_decoding_backend": "the server's --structured-outputs-backend picks the grammar engine",
}


def output_constraint(
    response_format: ResponseFormat | None,
    structured_outputs: dict[str, Any] | None,
    guided: Mapping[str, Any],
    extra: Mapping[str, Any],
) -> StructuredOutputsParams | None:
    """The one output constraint of a request, from whichever field set it, with
    ``structured_outputs``' options (``disable_any_whitespace``) applied; ``None`` if none.

    ``guided`` holds the ``guided_*`` fields by name (``GUIDED_FIELDS``), ``extra`` the request's
    unknown fields (where the refused ``guided_*`` options are looked for). Raises
    ``InvalidRequestError`` when two fields constrain the output, or one is invalid.
    """
    for name, instead in _REFUSED.items():
        if extra.get(name) is not None:
            raise InvalidRequestError(f"{name} is not supported per request; {instead}", name)
    options = dict(structured_outputs or {})
    given: dict[str, dict[str, Any]] = {}  # field -> the constraint it sets
    for kind in KINDS:
        if options.get(kind) not in (None, False):
            given[f"structured_outputs.{kind}"] = {kind: options.pop(kind)}
    if response_format is not None and (constraint := response_format.constraint()):
        given["response_format"] = constraint
    for name, kind in GUIDED_FIELDS.items():
        if guided.get(name) is not None:
            given[name] = {kind: guided[name]}
    if len(given) > 1:
        first, second = list(given)[:2]
        raise InvalidRequestError(
            f"{first} and {second} both constrain the output; give only one", second
        )
    if not given and not options:
        return None
    return StructuredOutputsParams.from_dict({**options, **next(iter(given.values()), {})})
