"""The KV-connector contract: the objects a connector plugin supplies, and what the core gives it.

A connector has two sides, built separately by its plugin's hooks (``kv_transfer.hookspecs``):

- **Scheduler side** (:class:`KVConnectorScheduler`), in the engine-core process, on the
  scheduler's thread, pure Python. It says how many prompt tokens a remote instance holds for a
  request, learns which local blocks receive them (the load is asynchronous: the request waits,
  without running, until the worker side reports it finished), says
  what happens to a finished request's blocks (held for a peer, or freed now) and builds each
  step's metadata for the worker side.
- **Worker side** (:class:`KVConnectorWorker`), next to the KV cache. It is given the cache
  (:class:`KVCacheAccess`, blocks in the canonical layout whatever the backend's own), starts
  loads before the forward pass, offers blocks after it, and reports finished transfers and blocks
  that failed to load.

Blocks move in one canonical layout, ``[blocks, layers, 2, block_size, kv_heads, head_size]``
(K then V, tokens in order), so instances on different backends can be paired. Every call is
made on the engine loop's thread; a connector runs its own threads for network work and hands
results over through ``KVConnectorWorker.get_finished``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class KVConnectorInfo:
    """One row of ``platform-core kv-connectors``: a connector a plugin provides.

    ``api_version`` is the connector API (``KV_CONNECTOR_API_VERSION``) the plugin implements.
    """

    name: str
    package: str
    version: str
    api_version: tuple[int, int]
    description: str = ""


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The canonical shape of one instance's blocks; a peer must match it to exchange blocks.

    ``dtype`` is the torch dtype's name (``"bfloat16"``); importing converts, so peers of
    different dtypes can still be paired, at a loss of precision the user chose.
    """

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    element_size: int

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """One block across all layers: ``[layers, 2, block_size, kv_heads, head_size]``."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_size)

    @property
    def bytes_per_block(self) -> int:
        return (
            2
            * self.num_layers
            * self.block_size
            * self.num_kv_heads
            * self.head_size
            * self.element_size
        )

    def compatible(self, other: KVLayout) -> bool:
        """Whether blocks of ``other`` can be imported here (same shape; dtypes may differ)."""
        return self.block_shape == other.block_shape


class ConnectorRequest(Protocol):
    """What a connector reads of a request: its id, tokens and transfer parameters."""

    @property
    def request_id(self) -> str: ...

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None: ...


@dataclass(frozen=True, slots=True)
class RemoteTokens:
    """Tokens a remote instance holds for a request, after those cached locally.

    Loads are asynchronous: the request waits, neither running nor holding up others, until
    the worker side reports the load in ``finished_recving`` (a connector that loads
    synchronously, in ``start_load_kv``, reports it at that step's ``get_finished``). The
    blocks' tokens count as computed only then, so a failed block never reaches a forward pass.
    """

    num_tokens: int


@dataclass(frozen=True, slots=True)
class FinishedRequestKV:
    """What becomes of a finished request's blocks.

    ``hold`` keeps them (for a peer to read) until the worker side reports the request in
    ``finished_sending`` or the hold times out; ``params`` go back to the client with the
    request's output (``kv_transfer_params``), e.g. where a decode instance finds the blocks.
    """

    hold: bool = False
    params: dict[str, Any] | None = None


@dataclass(slots=True)
class TransferStats:
    """Counters of one worker since its previous report (the engine sums them)."""

    bytes_received: int = 0
    bytes_sent: int = 0
    blocks_received: int = 0
    blocks_sent: int = 0
    failed_blocks: int = 0
    failed_transfers: int = 0
    latencies_s: list[float] = field(default_factory=list)  # one per finished load

    def add(self, other: TransferStats) -> None:
        """Accumulate ``other`` into this one."""
        self.bytes_received += other.bytes_received
        self.bytes_sent += other.bytes_sent
        self.blocks_received += other.blocks_received
        self.blocks_sent += other.blocks_sent
        self.failed_blocks += other.failed_blocks
        self.failed_transfers += other.failed_transfers
        self.latencies_s.extend(other.latencies_s)


@dataclass(slots=True)
class KVConnectorOutput:
    """What the worker side reports after a step.

    ``finished_sending``: held requests whose peer has what it needs (their blocks may be freed).
    ``finished_recving``: requests whose asynchronous loads ended, well or not.
    ``failed_blocks``: per request, local block ids that did not load (missing, corrupt, the peer
    gone); the scheduler recomputes from the first of them on.
    """

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_blocks: dict[str, list[int]] = field(default_factory=dict)
    stats: TransferStats = field(default_factory=TransferStats)

    @property
    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.failed_blocks)


class KVCacheAccess(ABC):
    """One rank's KV cache as a connector sees it: whole blocks in the canonical layout."""

    layout: KVLayout

    @abstractmethod
    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A new contiguous host tensor ``[n, layers, 2, block_size, kv_heads, head_size]``."""

    @abstractmethod
    def import_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Write canonical ``blocks`` (any device, converted to the cache's dtype) at
        ``block_ids``; other blocks are untouched."""


class KVConnectorScheduler(ABC):
    """The scheduler side of a connector. Calls come from the scheduler; mutate only the
    connector's own state."""

    @abstractmethod
    def remote_tokens(self, request: ConnectorRequest, num_local_tokens: int) -> RemoteTokens:
        """Tokens after the first ``num_local_tokens`` (cached here, whole blocks) that a remote
        instance holds for ``request`` and this instance should load; ``RemoteTokens(0)`` for
        none. Asked once per request, when it is first admitted. The scheduler never loads the
        last prompt token (its logits are needed: it is computed here), so it may load fewer
        than offered (see ``release`` for none at all); the last loaded block may be partial."""

    @abstractmethod
    def blocks_allocated(
        self, request: ConnectorRequest, block_ids: list[int], first_block: int
    ) -> None:
        """``block_ids`` receive the request's blocks ``first_block, first_block + 1, ...``
        (in its own token order); called after ``remote_tokens`` asked for them."""

    @abstractmethod
    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int], num_computed_tokens: int
    ) -> FinishedRequestKV:
        """``request`` finished normally (not aborted); ``block_ids`` hold its first
        ``num_computed_tokens`` tokens. Say whether to hold the blocks for a peer."""

    @abstractmethod
    def release(self, request_id: str, reason: str) -> None:
        """The core stops holding ``request_id``'s blocks or loading into them: ``reason`` is
        ``"timeout"`` (a hold expired), ``"aborted"`` (a load's request was aborted) or
        ``"unused"`` (``remote_tokens`` offered tokens the scheduler does not load: the prompt
        is computed here, e.g. for its prompt logprobs). The worker side must stop reading or
        writing the blocks from the next step on."""

    @abstractmethod
    def build_metadata(self) -> Any:
        """This step's instructions for the worker side (picklable), then start a new step."""

    def shutdown(self) -> None:  # noqa: B027 - optional, nothing to release by default
        """The engine is stopping."""


class KVConnectorWorker(ABC):
    """The worker side of a connector; every method is called on the engine loop's thread."""

    @abstractmethod
    def register_kv_caches(self, cache: KVCacheAccess) -> None:
        """The KV cache is allocated: keep ``cache`` (start serving peers here)."""

    @abstractmethod
    def start_load_kv(self, metadata: Any) -> None:
        """Before the step's forward pass: apply ``metadata`` (start asynchronous loads, finish
        synchronous ones, drop released requests)."""

    @abstractmethod
    def save_kv(self, metadata: Any) -> None:
        """After the step's forward pass: the blocks it computed are in the cache."""

    @abstractmethod
    def get_finished(self) -> KVConnectorOutput:
        """Transfers that ended since the previous call (imports done on this thread)."""

    def shutdown(self) -> None:  # noqa: B027 - optional, nothing to release by default
        """The engine is stopping: close sockets and threads."""
