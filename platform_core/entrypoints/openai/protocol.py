"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Unknown request fields are accepted and ignored, as vLLM does (``ignored_fields`` names them, for a
log line and a response header; ``--strict-request-fields`` makes them a 400). Types are strict, as
OpenAI's schema says: an integer field takes a JSON integer (not ``2.0`` or ``true``), a boolean a
JSON boolean (not ``"yes"``); a number field takes any JSON number. Integers are bounded to int64,
what JSON APIs and torch can carry. Text fields refuse lone surrogates (JSON ``"\ud800"``: not
Unicode, so no tokenizer or UTF-8 encoder takes them); NULs and non-characters are valid Unicode
and pass. The ranges of sampling values are checked in one place, ``SamplingParams``, when
``sampling_params`` builds it.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StringConstraints,
    Tag,
    model_validator,
)

from platform_core.errors import InvalidRequestError
from platform_core.sampling_params import SamplingParams
from platform_core.structured_outputs_params import KINDS, StructuredOutputsParams

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


# Sampling fields that fall back to the model's generation-config defaults when left out.
_DEFAULTABLE = (
    "temperature",
    "top_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "allowed_token_ids",
)


class _Request(BaseModel):
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


class StreamOptions(_Request):
    """``include_usage``: one last chunk with usage and no choices; ``continuous_usage_stats``:
    usage (so far) in every chunk too."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaSpec(_Request):
    """``response_format.json_schema``: a named JSON schema the output must match.

    ``strict`` is accepted for OpenAI's clients; the schema is always enforced exactly.
    """

    name: Text
    description: Text | None = None
    schema_: dict[Text, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TagStructure(_Request):
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


class ResponseFormat(_Request):
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
_GUIDED = {
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


class SamplingRequest(_Request):
    """Fields shared by completions and chat: OpenAI's names plus vLLM's sampling extras.

    A field left unset takes the model's generation-config default, then ``SamplingParams``'s.
    """

    model: Text | None = None
    n: Int64 = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: Int64 | None = None
    stop: Text | list[Text] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[TokenIdKey, float] | None = None
    # OpenAI fields that change nothing here (no stored completions, one service tier).
    user: Text | None = None
    store: bool | None = None
    metadata: dict[Text, Text] | None = None
    service_tier: Text | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: bool = False
    min_tokens: Int64 = 0
    skip_special_tokens: bool = True
    allowed_token_ids: TokenIds | None = None
    prompt_logprobs: Int64 | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    # Keep only the last k prompt tokens (-1: as many as the context holds).
    truncate_prompt_tokens: Int64 | None = None
    # vLLM's beam search: ``n`` beams ranked by cum_logprob / length ** length_penalty.
    use_beam_search: bool = False
    length_penalty: float = Field(default=1.0, allow_inf_nan=False)
    # Seconds the whole request may take, queueing included; past it the request is aborted.
    timeout: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    # Output constraints: at most one of these may set one (``structured_outputs_params``).
    response_format: ResponseFormat | None = None
    # vLLM's: the fields of ``StructuredOutputsParams`` (checked, unknown keys refused, there).
    structured_outputs: dict[Text, Any] | None = None
    guided_json: dict[Text, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    # vLLM's disaggregated prefill: instructions for the engine's KV connector (e.g.
    # ``{"do_remote_decode": true}``, or what a prefill instance returned), passed on as they are.
    kv_transfer_params: dict[Text, Any] | None = None

    def deadline(self) -> float | None:
        """``timeout`` as a ``time.monotonic()`` deadline counted from now; ``None`` if unset."""
        return None if self.timeout is None else time.monotonic() + self.timeout

    def sampling_params(self, defaults: dict[str, Any], **values: Any) -> SamplingParams:
        """``SamplingParams`` from the request; ``values`` (API-specific, mapped) override all.

        Raises ``InvalidRequestError`` naming the offending field.
        """
        settings = dict(defaults)
        for name in _DEFAULTABLE:
            value = getattr(self, name)
            if value is not None:
                settings[name] = value
        settings.update(
            n=self.n,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias={int(token): bias for token, bias in (self.logit_bias or {}).items()},
            structured_outputs=self.structured_outputs_params(),
        )
        settings.update(values)
        return SamplingParams(**settings)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one output constraint of the request, from whichever field set it
        (``response_format``, ``structured_outputs`` or a ``guided_*`` field), with
        ``structured_outputs``' options (``disable_any_whitespace``) applied; ``None`` if none.

        Raises ``InvalidRequestError`` when two fields constrain the output, or one is invalid.
        """
        extra = self.model_extra or {}
        for name, instead in _REFUSED.items():
            if extra.get(name) is not None:
                raise InvalidRequestError(f"{name} is not supported per request; {instead}", name)
        options = dict(self.structured_outputs or {})
        given: dict[str, dict[str, Any]] = {}  # field -> the constraint it sets
        for kind in KINDS:
            if options.get(kind) not in (None, False):
                given[f"structured_outputs.{kind}"] = {kind: options.pop(kind)}
        if self.response_format is not None and (constraint := self.response_format.constraint()):
            given["response_format"] = constraint
        for name, kind in _GUIDED.items():
            if getattr(self, name) is not None:
                given[name] = {kind: getattr(self, name)}
        if len(given) > 1:
            first, second = list(given)[:2]
            raise InvalidRequestError(
                f"{first} and {second} both constrain the output; give only one", second
            )
        if not given and not options:
            return None
        params = StructuredOutputsParams.from_dict({**options, **next(iter(given.values()), {})})
        if self.use_beam_search:
            raise InvalidRequestError(
                "beam search cannot follow an output constraint", "use_beam_search"
            )
        return params


def _prompt_shape(value: Any) -> str:
    """Which form of ``prompt`` a value has, judged by its first element: one union branch is
    then validated, not each in turn (a failed branch over 500,000 ids costs ~0.2 s of errors).
    The tags read as types, so error locations leave them out (``errors._is_field``)."""
    if isinstance(value, str):
        return "str"
    if isinstance(value, list) and value:
        first = value[0]
        if isinstance(first, str):
            return "list[str]"
        if isinstance(first, list):
            return "list[list[int]]"
    return "list[int]"


PromptField = Annotated[
    Annotated[Text, Tag("str")]
    | Annotated[list[Text], Tag("list[str]")]
    | Annotated[TokenIds, Tag("list[int]")]
    | Annotated[list[TokenIds], Tag("list[list[int]]")],
    Discriminator(_prompt_shape),
]


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: ``prompt`` is a string, strings, token ids, or lists of them."""

    prompt: PromptField
    max_tokens: Int64 | None = None
    logprobs: Int64 | None = None
    echo: bool = False
    best_of: Int64 | None = None
    # Fill-in-the-middle; refused unless empty (no served model renders it).
    suffix: Text | None = None


class ContentPart(BaseModel):
    """One part of a message's content; only ``{"type": "str", "str": ...}`` is supported."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Text
    text: Text | None = None


class CalledFunction(_Request):
    """The function an earlier assistant turn called: ``arguments`` is its JSON text."""

    name: Text
    arguments: Text


class MessageToolCall(_Request):
    """One tool call of an earlier assistant turn (``messages[i].tool_calls``)."""

    id: Text
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Request):
    """One chat turn, passed to the model's chat template: an assistant turn may carry its
    ``tool_calls``, a ``tool`` turn the ``tool_call_id`` it answers."""

    role: Text
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: Text | None = None


class FunctionDefinition(_Request):
    """A function the model may call; ``parameters`` is the JSON schema of its arguments."""

    name: Text
    description: Text | None = None
    parameters: dict[Text, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Request):
    """One entry of ``tools``: OpenAI's ``{"type": "function", "function": {...}}``."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: Text


class NamedToolChoice(_Request):
    """``tool_choice`` forcing one function: ``{"type": "function", "function": {"name"}}``."""

    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # Prepend the last message's content to the reply when it is the assistant's.
    echo: bool = False
    chat_template: Text | None = None
    chat_template_kwargs: dict[Text, Any] | None = None
    tools: list[ToolDefinition] | None = None
    # None: "auto" when the server enables it (--enable-auto-tool-choice) and tools are given.
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def tool_dicts(self) -> list[dict[str, Any]]:
        """``tools`` as plain dicts (what chat templates and the call schema read)."""
        return [tool.model_dump(exclude_unset=True) for tool in self.tools or []]


class TokenizeRequest(_Request):
    """``POST /tokenize``: exactly one of ``prompt`` and ``messages``, with vLLM's fields.

    ``add_special_tokens`` defaults as in vLLM: on for a prompt, off for messages (the chat
    template writes its own). The other chat fields are for ``messages`` only; ``tools`` and
    ``chat_template_kwargs`` reach the chat template as its ``tools`` and variables.
    """

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False
    tools: list[dict[Text, Any]] | None = None
    chat_template: Text | None = None
    chat_template_kwargs: dict[Text, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        if self.prompt is not None:
            chat_only = sorted(_CHAT_ONLY_TOKENIZE_FIELDS & self.model_fields_set)
            if chat_only:
                raise ValueError(f"{', '.join(chat_only)} apply to 'messages', not 'prompt'")
        if self.continue_final_message and self.add_generation_prompt:
            if "add_generation_prompt" in self.model_fields_set:
                raise ValueError(
                    "continue_final_message and add_generation_prompt cannot both be true"
                )
            self.add_generation_prompt = False  # its default gives way to the explicit field
        return self


_CHAT_ONLY_TOKENIZE_FIELDS = frozenset(
    {
        "add_generation_prompt",
        "continue_final_message",
        "tools",
        "chat_template",
        "chat_template_kwargs",
    }
)


class DetokenizeRequest(_Request):
    """``POST /detokenize``."""

    model: Text | None = None
    tokens: TokenIds


NonEmptyText = Annotated[Text, StringConstraints(min_length=1)]


class LoadLoRAAdapterRequest(_Request):
    """``POST /v1/load_lora_adapter`` (vLLM's): serve the PEFT adapter in ``lora_path`` as the
    model ``lora_name``."""

    lora_name: NonEmptyText
    lora_path: NonEmptyText


class UnloadLoRAAdapterRequest(_Request):
    """``POST /v1/unload_lora_adapter`` (vLLM's): the adapter by its name or its id."""

    lora_name: NonEmptyText | None = None
    lora_int_id: Int64 | None = None

    @model_validator(mode="after")
    def _named(self) -> UnloadLoRAAdapterRequest:
        if self.lora_name is None and self.lora_int_id is None:
            raise ValueError("give lora_name or lora_int_id")
        return self


# ---------------------------------------------------------------------------------- responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    """Token counts of a response; ``cached_tokens`` were served from the prefix cache."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One token's entry in ``prompt_logprobs`` (vLLM's shape)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt position (the first is null), token id -> its entry.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    """A completion choice; the vLLM fields are null unless asked for."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    """A whole completion, or (streaming) one chunk of it; ``kv_transfer_params`` are what the
    engine's KV connector returned for the request (on the response, or the chunk that finishes
    the request), null without one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ChatToolCall(BaseModel):
    """A tool call of a reply; ``function.arguments`` is a JSON object's text."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    """A reply: ``content`` is null when the model only called tools (or only reasoned);
    ``reasoning_content`` holds the reasoning with ``--reasoning-parser``."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ChatToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    """A whole chat completion; the vLLM prompt fields are null unless asked for, and
    ``kv_transfer_params`` unless the engine's KV connector returned some."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, Any] | None = None


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


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCallItem] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    """One chunk of a streamed chat completion (``kv_transfer_params`` as in the response)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, Any] | None = None
