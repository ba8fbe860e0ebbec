"""How the built-in connectors move bytes: a ``BlockTransport`` carries ``BlockBatch``es.

The built-in connectors (``pull_scheduler``, ``pull_worker``) share one protocol: the producer
keeps a finished prompt's blocks and serves them as a ``BlockSource``; the consumer asks for the
block positions its own cache lacks (``fetch``), then says it has them (``confirm``) so the
producer frees its copy.
Transports differ only in how a batch crosses: a TCP stream, a shared-memory segment, a function
call in one process. Checksums are made by the source and verified by the consumer's connector,
not by the transport, so a transport that damages bytes is caught whatever it is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from platform_core.errors import PlatformCoreError
from platform_core.kv_transfer.interfaces import KVLayout

if TYPE_CHECKING:
    import torch


class TransferError(PlatformCoreError, RuntimeError):
    """A transfer could not be made (the peer is unreachable, refused it or broke off)."""


class UnknownTransferError(TransferError):
    """The producer holds no blocks under this transfer id (never held, released, timed out)."""


@dataclass(slots=True)
class BlockBatch:
    """Blocks of one transfer in the canonical layout.

    ``data`` is ``[n, layers, 2, block_size, kv_heads, head_size]`` on the host, contiguous,
    one row per asked position; ``checksums`` the CRC-32 of each row's bytes (empty when the
    source does not checksum); ``missing`` the indexes into the asked positions the source could
    not supply (their rows are unspecified).
    """

    data: torch.Tensor
    checksums: list[int] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)


class BlockSource(Protocol):
    """The producer's held blocks, as a transport's server reads them (from its own threads)."""

    layout: KVLayout

    def read(self, transfer_id: str, positions: list[int]) -> BlockBatch:
        """Blocks ``positions`` (indexes in the request's block table) of ``transfer_id``.
        Raises ``UnknownTransferError`` when nothing is held under that id."""

    def confirm(self, transfer_id: str) -> None:
        """The consumer has what it needs: the blocks may be freed (unknown ids ignored)."""


class BlockTransport(ABC):
    """Carries block batches between a producer and consumers. Producer methods: ``serve``,
    ``address``; consumer methods: ``fetch``, ``confirm``; both: ``close``. ``fetch`` and
    ``confirm`` are called from the connector's own threads and block."""

    @abstractmethod
    def serve(self, source: BlockSource) -> None:
        """Start answering consumers' fetches and confirmations from ``source``."""

    @abstractmethod
    def address(self) -> dict[str, Any]:
        """Where consumers reach this producer (JSON-able; goes into ``kv_transfer_params``)."""

    @abstractmethod
    def fetch(
        self, address: dict[str, Any], transfer_id: str, positions: list[int], layout: KVLayout
    ) -> BlockBatch:
        """Blocks ``positions`` of ``transfer_id`` from the producer at ``address``, in the
        producer's dtype. ``layout`` is the consumer's: a producer whose blocks have another
        shape is refused. Raises ``TransferError`` when the producer cannot be reached, refuses
        or has other block shapes (``UnknownTransferError``: it holds nothing under that id)."""

    @abstractmethod
    def confirm(self, address: dict[str, Any], transfer_id: str) -> None:
        """Tell the producer its blocks of ``transfer_id`` may be freed. Raises
        ``TransferError`` when it cannot be reached."""

    def close(self) -> None:  # noqa: B027 - optional, nothing to release by default
        """Stop serving and release sockets, segments and threads."""
