"""Typed messages between the scheduler and the model runner.

``SchedulerOutput`` carries everything the input builder needs as plain data, so it can cross a
process boundary without the scheduler's objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from platform_core.kv_transfer.interfaces import KVConnectorOutput
from platform_core.lora_request import LoRARequest
from platform_core.sample.logprobs import TokenLogprobs
from platform_core.sampling_params import SamplingParams


@dataclass(slots=True, kw_only=True)
class ScheduledRequest:
    """One request's share of a step: compute ``token_ids`` starting at ``start_position``.

    ``block_ids`` are the request's KV blocks from index ``first_block`` on: the model runner
    keeps each running request's block table across steps, so a step sends only the blocks added
    since the request's previous step (``first_block == 0``: the whole table).

    ``sample`` is True when this step reaches the end of the known tokens, so the last position's
    logits are sampled. The last ``num_draft_tokens`` of ``token_ids`` are speculative drafts:
    the last ``1 + num_draft_tokens`` positions are all scored and verified. ``fork_ids`` names
    the extra samples of an ``n > 1`` request that fork off on this step's token (sampled from the
    same logits). ``prompt_token_ids`` and ``output_token_ids`` are the request's own lists
    (shared, not copied, in process) for penalties and prompt logprobs. ``token_bitmask``
    (``[1 + num_draft_tokens, words]`` int32, set on the driver for a request with a
    ``structured_outputs`` constraint) holds the tokens allowed at each sampled position.
    ``lora_request`` is the adapter every token of the request runs with (None: the base model).
    """

    request_id: str
    token_ids: list[int]
    start_position: int
    block_ids: list[int]
    sample: bool
    sampling_params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    fork_ids: list[str] = field(default_factory=list)
    num_draft_tokens: int = 0
    draft_probs: Any = None
    first_block: int = 0
    token_bitmask: Any = None
    lora_request: LoRARequest | None = None

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens :]

    @property
    def num_blocks(self) -> int:
        """Blocks in the request's table once this step's are added."""
        return self.first_block + len(self.block_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Tokens of the sequence once this step's tokens are computed."""
        return self.start_position + len(self.token_ids)


@dataclass(slots=True, kw_only=True)
class SchedulerOutput:
    """What to run in one step; ``block_copies`` run before the forward pass.

    ``kv_connector_metadata`` is the KV connector's instructions to its worker side (None
    without a connector); a step may carry them with nothing scheduled.
    """

    scheduled: list[ScheduledRequest]
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    kv_connector_metadata: Any = None

    @property
    def total_num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True, kw_only=True)
class ModelRunnerOutput:
    """Results of one step, keyed by request id (fork children included).

    ``sampled`` holds the new tokens of each request that sampled; ``logprobs`` their logprobs
    when asked for; ``prompt_logprobs`` maps a request to ``(first, entries)``: the logprobs of
    prompt tokens ``first, first + 1, ...`` computed this step. ``kv_connector`` is the KV
    connector's report (None without a connector).
    """

    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    kv_connector: KVConnectorOutput | None = None
