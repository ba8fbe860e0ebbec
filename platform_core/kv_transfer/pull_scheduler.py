"""The built-in connectors' scheduler side: producers hold finished prompts' blocks, consumers
ask for what their prefix cache lacks.

On a producer, a request that came with ``{"do_remote_decode": true}`` keeps its blocks when it
finishes, and its output carries the parameters a consumer needs (``remote_*``). On a consumer,
a request that came with those parameters loads the blocks its own prefix cache lacks; one
fully cached here (or computed here for other reasons) only tells the producer to free them.
The worker side (``pull_worker``) carries out each step's ``PullMetadata``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from platform_core.config import KVTransferConfig
from platform_core.kv_transfer.interfaces import (
    ConnectorRequest,
    FinishedRequestKV,
    KVConnectorScheduler,
    RemoteTokens,
)

logger = logging.getLogger("platform_core.kv_transfer")


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Fetch blocks ``positions`` of the producer's ``transfer_id`` into ``block_ids``."""

    request_id: str
    address: dict[str, Any]
    transfer_id: str
    positions: list[int]
    block_ids: list[int]


@dataclass(slots=True)
class PullMetadata:
    """One step's instructions to the worker side.

    ``holds``: transfer id -> the held blocks, in token order (producer). ``loads``: fetches to
    start (consumer). ``confirms``: ``(address, transfer id)`` of producers whose blocks this
    consumer does not need after all. ``releases``: ids no longer held (producer) or whose load
    was abandoned (consumer).
    """

    holds: dict[str, list[int]] = field(default_factory=dict)
    loads: list[LoadSpec] = field(default_factory=list)
    confirms: list[tuple[dict[str, Any], str]] = field(default_factory=list)
    releases: list[str] = field(default_factory=list)


class PullScheduler(KVConnectorScheduler):
    """Scheduler side of the built-in connectors; ``address`` is where this instance's
    transport serves (what consumers are told)."""

    def __init__(
        self, name: str, config: KVTransferConfig, block_size: int, address: dict[str, Any]
    ):
        self.name = name
        self.config = config
        self.block_size = block_size
        self.address = address
        self.engine_id = config.engine_id or ""
        self._metadata = PullMetadata()
        self._params: dict[str, dict[str, Any]] = {}  # consumer: request id -> its params

    def remote_tokens(self, request: ConnectorRequest, num_local_tokens: int) -> RemoteTokens:
        params = self._remote_params(request)
        if params is None:
            return RemoteTokens(0)
        num_tokens = max(0, params["remote_num_tokens"] - num_local_tokens)
        if num_tokens <= 0:
            # Nothing worth loading (the prompt is cached here): let the producer free it now.
            self._metadata.confirms.append((params["remote_address"], params["remote_request_id"]))
            return RemoteTokens(0)
        self._params[request.request_id] = params
        return RemoteTokens(num_tokens)

    def _remote_params(self, request: ConnectorRequest) -> dict[str, Any] | None:
        params = request.kv_transfer_params
        if not self.config.is_consumer or not params or not params.get("do_remote_prefill"):
            return None
        try:
            valid = (
                isinstance(params["remote_request_id"], str)
                and isinstance(params["remote_address"], dict)
                and isinstance(params["remote_num_tokens"], int)
                and params["remote_block_size"] == self.block_size
            )
        except KeyError:
            valid = False
        if not valid:
            logger.warning(
                "request %s: kv_transfer_params from another kind of producer (or another "
                "block size): its prompt is computed here",
                request.request_id,
            )
            return None
        return params

    def blocks_allocated(
        self, request: ConnectorRequest, block_ids: list[int], first_block: int
    ) -> None:
        params = self._params.pop(request.request_id)
        positions = list(range(first_block, first_block + len(block_ids)))
        self._metadata.loads.append(
            LoadSpec(
                request.request_id,
                params["remote_address"],
                params["remote_request_id"],
                positions,
                list(block_ids),
            )
        )

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int], num_computed_tokens: int
    ) -> FinishedRequestKV:
        params = request.kv_transfer_params
        if not self.config.is_producer or not params or not params.get("do_remote_decode"):
            return FinishedRequestKV()
        # A consumer computes the last prompt token itself (for its logits): it may load the
        # rest, the block of the last token included.
        loadable = min(num_computed_tokens, len(request.prompt_token_ids) - 1)
        num_blocks = -(-loadable // self.block_size)
        hold = num_blocks > 0
        if hold:
            self._metadata.holds[request.request_id] = list(block_ids[:num_blocks])
        return FinishedRequestKV(
            hold=hold,
            params={
                "do_remote_prefill": True,
                "remote_connector": self.name,
                "remote_engine_id": self.engine_id,
                "remote_request_id": request.request_id,
                "remote_address": self.address,
                "remote_num_tokens": loadable,
                "remote_block_size": self.block_size,
            },
        )

    def release(self, request_id: str, reason: str) -> None:
        params = self._params.pop(request_id, None)
        if params is not None and reason == "unused":  # the producer may free its copy
            self._metadata.confirms.append((params["remote_address"], params["remote_request_id"]))
            return
        self._metadata.releases.append(request_id)

    def build_metadata(self) -> PullMetadata:
        metadata, self._metadata = self._metadata, PullMetadata()
        return metadata
