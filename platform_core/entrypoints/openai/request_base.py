"""The base model of the API's request bodies and their field types.

Unknown request fields are accepted and ignored, as vLLM does (``ignored_fields`` names them, for a
log line and a response header; ``--strict-request-fields`` makes them a 400). Types are strict, as
OpenAI's schema says: an integer field takes a JSON integer (not ``2.0`` or ``true``), a boolean a
JSON boolean (not ``"yes"``); a number field takes any JSON number. Integers are bounded to int64,
what JSON APIs and torch can carry. Text fields refuse lone surrogates (JSON ``"\ud800"``: not
Unicode, so no tokenizer or UTF-8 encoder takes them); NULs and non-characters are valid Unicode
and pass.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
TokenIds = list[Int64]
_SURROGATE = re.compile("[\ud800-\udfff]")


def _no_lone_surrogates(text: str) -> str:
    if not text.isascii() and (found := _SURROGATE.search(text)):
        raise ValueError(
            f"contains a lone surrogate (U+{ord(found.group()):04X}) at character "
            f"{found.start()}, which is not Unicode text"
        )
    return text


Text = Annotated[str, AfterValidator(_no_lone_surrogates)]
# logit_bias keys are token ids written in ASCII digits (int() would also take "１２" or " 12").
TokenIdKey = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,19}$")]
NonEmptyText = Annotated[Text, StringConstraints(min_length=1)]


class RequestModel(BaseModel):
    """Base of the request bodies: strict types, unknown fields kept (``ignored_fields``)."""

    model_config = ConfigDict(extra="allow", strict=True)


def ignored_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Dotted names of the fields ``model`` (and the models inside it) kept but does not know,
    e.g. ``["store", "messages.0.cache_control"]``."""
    names = [prefix + name for name in model.model_extra or {}]
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            names += ignored_fields(value, f"{prefix}{name}.")
        elif isinstance(value, list) and value and isinstance(value[0], BaseModel):
            # Lists hold models or scalars, never both: a list of ids is not walked.
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    names += ignored_fields(item, f"{prefix}{name}.{i}.")
    return names
