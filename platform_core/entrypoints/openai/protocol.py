"""Request bodies of the OpenAI-compatible API (pydantic models): completions, chat, tokenize,
detokenize and vLLM's LoRA adapter routes.

Their base model and field types (strict, unknown fields kept) are in ``request_base``, the
output constraints in ``output_constraints``, the tool models in ``tool_protocol``, the response
bodies in ``response_bodies``. The ranges of sampling values are checked in one place,
``SamplingParams``, when ``sampling_params`` builds it.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from platform_core.entrypoints.openai.output_constraints import (
    GUIDED_FIELDS,
    ResponseFormat,
    output_constraint,
)
from platform_core.entrypoints.openai.request_base import (
    Int64,
    NonEmptyText,
    RequestModel,
    Text,
    TokenIdKey,
    TokenIds,
)
from platform_core.entrypoints.openai.tool_protocol import (
    MessageToolCall,
    NamedToolChoice,
    ToolDefinition,
)
from platform_core.errors import InvalidRequestError
from platform_core.sampling_params import SamplingParams
from platform_core.structured_outputs_params import StructuredOutputsParams

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


class StreamOptions(RequestModel):
    """``include_usage``: one last chunk with usage and no choices; ``continuous_usage_stats``:
    usage (so far) in every chunk too."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingRequest(RequestModel):
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
        params = output_constraint(
            self.response_format,
            self.structured_outputs,
            guided={name: getattr(self, name) for name in GUIDED_FIELDS},
            extra=self.model_extra or {},
        )
        if params is not None and self.use_beam_search:
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


class ChatMessage(RequestModel):
    """One chat turn, passed to the model's chat template: an assistant turn may carry its
    ``tool_calls``, a ``tool`` turn the ``tool_call_id`` it answers."""

    role: Text
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: Text | None = None


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


class TokenizeRequest(RequestModel):
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


class DetokenizeRequest(RequestModel):
    """``POST /detokenize``."""

    model: Text | None = None
    tokens: TokenIds


class LoadLoRAAdapterRequest(RequestModel):
    """``POST /v1/load_lora_adapter`` (vLLM's): serve the PEFT adapter in ``lora_path`` as the
    model ``lora_name``."""

    lora_name: NonEmptyText
    lora_path: NonEmptyText


class UnloadLoRAAdapterRequest(RequestModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's): the adapter by its name or its id."""

    lora_name: NonEmptyText | None = None
    lora_int_id: Int64 | None = None

    @model_validator(mode="after")
    def _named(self) -> UnloadLoRAAdapterRequest:
        if self.lora_name is None and self.lora_int_id is None:
            raise ValueError("give lora_name or lora_int_id")
        return self
