"""How a rank's parameter is filled from checkpoint tensors under tensor parallelism.

A layer that shards its weights answers ``placements(param_name)`` with one :class:`Placement`
per checkpoint tensor feeding that parameter (one per fused part, in part order). A parameter
of a layer without ``placements`` is filled whole from the tensor of the same name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Shard:
    """Entries ``[start, start + length)`` of a dimension of full size ``full``."""

    start: int
    length: int
    full: int

    @classmethod
    def whole(cls, size: int) -> Shard:
        """All ``size`` entries (a replicated dimension)."""
        return cls(0, size, size)


@dataclass(frozen=True, slots=True)
class Placement:
    """Copy ``source`` of the checkpoint tensor's ``dim`` into the parameter at ``dst_start``.

    Every other dimension of the checkpoint tensor equals the parameter's.
    """

    dim: int
    source: Shard
    dst_start: int = 0

    def checkpoint_shape(self, param: torch.Tensor) -> tuple[int, ...]:
        """The full shape the checkpoint tensor must have."""
        shape = list(param.shape)
        shape[self.dim] = self.source.full
        return tuple(shape)

    def source_index(self) -> tuple[slice, ...]:
        """The index selecting this rank's entries of the checkpoint tensor."""
        start = self.source.start
        return (*(slice(None),) * self.dim, slice(start, start + self.source.length))

    def destination(self, param: torch.Tensor) -> torch.Tensor:
        """The view of ``param`` the selected entries are copied into."""
        return param.narrow(self.dim, self.dst_start, self.source.length)


def whole_placement(param: torch.Tensor) -> Placement:
    """A replicated parameter: the checkpoint tensor is copied whole."""
    return Placement(0, Shard.whole(param.shape[0]))
