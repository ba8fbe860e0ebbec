"""The tensor-parallel group a model shard belongs to, passed explicitly into model construction.

There is no process-global parallel state: each model holds the :class:`TPGroup` it was built
with, and every collective of its layers goes through that group's communicator.
"""

from __future__ import annotations

from dataclasses import dataclass

from platform_core.distributed.communicator import Communicator
from platform_core.errors import ConfigError


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group of ``size`` ranks.

    ``communicator`` carries the group's collectives; it is required when ``size > 1`` and must
    agree on rank and size. ``size == 1`` means no sharding and no communication.
    """

    rank: int
    size: int
    communicator: Communicator | None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ConfigError(f"invalid tensor-parallel rank {self.rank} of size {self.size}")
        if self.size == 1:
            return
        comm = self.communicator
        if comm is None:
            raise ConfigError(f"a tensor-parallel group of size {self.size} needs a communicator")
        if (comm.rank, comm.world_size) != (self.rank, self.size):
            raise ConfigError(
                f"communicator is rank {comm.rank} of {comm.world_size}, but the group is "
                f"rank {self.rank} of {self.size}"
            )

    @classmethod
    def single(cls) -> TPGroup:
        """The trivial group: rank 0 of 1, no communicator."""
        return cls(rank=0, size=1, communicator=None)

    @classmethod
    def from_communicator(cls, communicator: Communicator) -> TPGroup:
        """The group spanned by ``communicator`` (its rank and world size)."""
        return cls(communicator.rank, communicator.world_size, communicator)

    @property
    def is_parallel(self) -> bool:
        """Whether there is more than one rank (so layers shard and communicate)."""
        return self.size > 1

    def shard_range(self, total: int, what: str = "size") -> tuple[int, int]:
        """``(start, length)`` of this rank's equal share of ``total`` items.

        ConfigError naming ``what`` when ``total`` is not divisible by the group size.
        """
        check_divisible(total, self.size, what)
        length = total // self.size
        return self.rank * length, length

    def padded_shard_range(self, total: int) -> tuple[int, int, int]:
        """``(start, length, padded)`` when ``total`` is padded up to a multiple of the size.

        Every rank holds ``padded`` slots; the first ``length`` of them are items
        ``[start, start + length)`` and the rest (only on the last ranks) are padding.
        """
        padded = -(-total // self.size)
        start = min(self.rank * padded, total)
        return start, min(padded, total - start), padded


def check_divisible(total: int, size: int, what: str) -> None:
    """ConfigError naming ``what`` unless ``total`` splits evenly over ``size`` ranks."""
    if total % size:
        raise ConfigError(f"{what}={total} is not divisible by tensor_parallel_size={size}")
