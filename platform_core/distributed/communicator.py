"""The collectives a backend supplies, and one implementation over ``torch.distributed``.

:class:`Communicator` is the contract (``Backend.communicator(group)`` returns one). Ranks in its
API are ranks *within its group*, not global ranks. Every rank of the group must call each
collective in the same order with tensors of the same shape and dtype; a mismatch is the caller's
bug and ends in a backend error or a hang (the process group's timeout), never a silent result.

:class:`TorchDistributedCommunicator` works over any ``torch.distributed`` backend (gloo on CPU; a
GPU backend passes its own group and device). When the backend refuses an op it does not
implement (older gloo builds lack ``reduce_scatter_tensor`` or ``all_to_all_single``), the op is
rebuilt once from ones it has and the native call is not tried again on that communicator.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class Communicator(ABC):
    """Collectives among the ranks of one group; the sum is the only reduction.

    Tensors live on the backend's device. Ops that fill a buffer (``all_reduce``, ``broadcast``,
    ``recv``) write into the given tensor and return it; the others return a new tensor and leave
    the input unchanged, except that with ``world_size == 1`` the input itself may be returned.
    Invalid arguments raise before any communication: ``ValueError`` for a bad peer rank or a
    size not divisible by ``world_size``, ``IndexError`` for a dim out of range.
    """

    @property
    @abstractmethod
    def rank(self) -> int:
        """This process's rank in the group, in ``[0, world_size)``."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """Number of ranks in the group (1: every collective returns its input)."""

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over all ranks, in place; returns ``tensor``."""

    @abstractmethod
    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along ``dim``, in rank order.

        The result's size along ``dim`` is ``world_size`` times the input's.
        """

    @abstractmethod
    def reduce_scatter(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum ``tensor`` over all ranks, then keep chunk ``rank`` of ``world_size`` along ``dim``.

        The size along ``dim`` must be divisible by ``world_size``; the result is a new contiguous
        tensor whose size along ``dim`` is the input's divided by ``world_size``.
        """

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with rank ``src``'s; returns ``tensor``."""

    @abstractmethod
    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` to rank ``dst`` (not this rank); blocks until it can be reused."""

    @abstractmethod
    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Receive from rank ``src`` (not this rank) into ``tensor``; returns ``tensor``.

        ``tensor`` must have the shape and dtype of the one sent.
        """

    @abstractmethod
    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        """Exchange equal chunks of dim 0: chunk ``j`` goes to rank ``j``.

        The size of dim 0 must be divisible by ``world_size``. The result has the input's shape;
        its chunk ``j`` is the chunk ``rank`` that rank ``j`` sent.
        """

    @abstractmethod
    def barrier(self) -> None:
        """Return only once every rank of the group has called ``barrier``."""

    def _check_peer(self, peer: int, role: str) -> None:
        """Raise ``ValueError`` unless ``peer`` is another rank of the group."""
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(
                f"{role}={peer} must be a rank in [0, {self.world_size}) other than this "
                f"rank ({self.rank})"
            )

    def _check_divisible(self, tensor: torch.Tensor, dim: int, op: str) -> None:
        """Raise ``ValueError`` unless ``tensor``'s size along ``dim`` splits evenly over ranks."""
        if tensor.shape[dim] % self.world_size:
            raise ValueError(
                f"{op}: size {tensor.shape[dim]} of dim {dim} is not divisible by "
                f"world_size {self.world_size}"
            )


class TorchDistributedCommunicator(Communicator):
    """A :class:`Communicator` over a ``torch.distributed`` process group.

    Args:
        group: the process group (``None``: the default one). Without an initialized default
            group and with ``group=None``, the communicator is a single rank (world size 1).
        device: where the communicator's own scratch tensors live (CPU by default); a GPU
            backend passes its device.
    """

    def __init__(self, group: Any = None, device: torch.device | None = None) -> None:
        self.group = group
        self.device = device if device is not None else torch.device("cpu")
        self._unsupported: set[str] = set()
        if group is None and not (dist.is_available() and dist.is_initialized()):
            self._rank, self._world_size = 0, 1
            return
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)
        if self._rank < 0:
            raise ValueError("this process is not a member of the given process group")

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        return _in_place(tensor, lambda buffer: dist.all_reduce(buffer, group=self.group))

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        dim = _normalize_dim(tensor, dim)
        if self.world_size == 1:
            return tensor
        # Rank r's tensor lands in gathered[r]; the list form works on every backend.
        gathered = tensor.new_empty((self.world_size, *tensor.shape))
        dist.all_gather(list(gathered.unbind(0)), tensor.contiguous(), group=self.group)
        return gathered.movedim(0, dim).flatten(dim, dim + 1)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        dim = _normalize_dim(tensor, dim)
        self._check_divisible(tensor, dim, "reduce_scatter")
        if self.world_size == 1:
            return tensor
        moved = tensor.movedim(dim, 0).contiguous()
        output = moved.new_empty((moved.shape[0] // self.world_size, *moved.shape[1:]))

        def native() -> torch.Tensor:
            dist.reduce_scatter_tensor(output, moved, group=self.group)
            return output

        def fallback() -> torch.Tensor:
            summed = self.all_reduce(moved.clone())
            return summed.chunk(self.world_size)[self.rank]

        result = self._native_or_fallback("reduce_scatter_tensor", native, fallback)
        return result.movedim(0, dim).contiguous()

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if not 0 <= src < self.world_size:
            raise ValueError(f"src={src} must be a rank in [0, {self.world_size})")
        if self.world_size == 1:
            return tensor
        return _in_place(
            tensor, lambda buffer: dist.broadcast(buffer, group=self.group, group_src=src)
        )

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self._check_peer(dst, "dst")
        dist.send(tensor.contiguous(), group=self.group, group_dst=dst)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        self._check_peer(src, "src")
        return _in_place(tensor, lambda buffer: dist.recv(buffer, group=self.group, group_src=src))

    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        self._check_divisible(tensor, _normalize_dim(tensor, 0), "all_to_all")
        if self.world_size == 1:
            return tensor
        source = tensor.contiguous()

        def native() -> torch.Tensor:
            output = torch.empty_like(source)
            dist.all_to_all_single(output, source, group=self.group)
            return output

        def fallback() -> torch.Tensor:
            # Gather everything (world_size times the traffic), keep what was meant for us.
            everything = self.all_gather(source.unsqueeze(0))
            return everything.unflatten(1, (self.world_size, -1))[:, self.rank].flatten(0, 1)

        return self._native_or_fallback("all_to_all_single", native, fallback)

    def barrier(self) -> None:
        if self.world_size == 1:
            return
        # A one-element all_reduce read back on the host waits for every rank on any backend,
        # including those whose dist.barrier would need to guess the device.
        token = torch.zeros(1, device=self.device)
        dist.all_reduce(token, group=self.group)
        token.item()

    def _native_or_fallback(
        self,
        op: str,
        native: Callable[[], torch.Tensor],
        fallback: Callable[[], torch.Tensor],
    ) -> torch.Tensor:
        """Run ``native`` unless the backend has refused ``op`` before; on refusal, ``fallback``.

        Refusal happens before any data moves and identically on every rank of one backend,
        so all ranks switch together.
        """
        if op not in self._unsupported:
            try:
                return native()
            except RuntimeError as error:
                if not _is_refusal(error):
                    raise
                self._unsupported.add(op)
                logger.info("process group lacks %s (%s); using a fallback", op, error)
        return fallback()


def _is_refusal(error: RuntimeError) -> bool:
    """Whether ``error`` says the backend does not implement the op at all.

    Anything else (a timeout, a dead peer, a shape mismatch) is a real failure and must
    propagate. c10d backends word a missing op as "Backend X does not support OP".
    """
    return isinstance(error, NotImplementedError) or "does not support" in str(error)


def _normalize_dim(tensor: torch.Tensor, dim: int) -> int:
    """``dim`` as a non-negative index of ``tensor``; ``IndexError`` when out of range."""
    if not -tensor.dim() <= dim < tensor.dim():
        raise IndexError(f"dim {dim} out of range for a tensor of {tensor.dim()} dims")
    return dim % tensor.dim()


def _in_place(tensor: torch.Tensor, op: Callable[[torch.Tensor], object]) -> torch.Tensor:
    """Apply a buffer-filling ``op`` to ``tensor``, through a contiguous copy if needed."""
    buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
    op(buffer)
    if buffer is not tensor:
        tensor.copy_(buffer)
    return tensor
