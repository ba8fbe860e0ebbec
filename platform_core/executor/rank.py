"""Building one rank of a tensor-parallel group: process group, backend, communicator, runner."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from platform_core.distributed.launch import (
    LoopbackGroupConfig,
    NodeGroupConfig,
    init_loopback_process_group,
    init_node_process_group,
)
from platform_core.executor.base import ModelSpec
from platform_core.plugins.manager import PluginManager
from platform_core.worker.model_runner import ModelRunner


def build_rank_runner(
    spec: ModelSpec,
    group: LoopbackGroupConfig | NodeGroupConfig,
    rank: int,
    while_waiting: Callable[[], None] | None = None,
    ranks_on_machine: int | None = None,
) -> ModelRunner:
    """Join the group as ``rank`` and load this rank's shard of the model.

    Blocks until every rank has joined (rank 0 calls ``while_waiting`` meanwhile, see
    ``init_loopback_process_group``); a ``NodeGroupConfig`` joins across machines. The backend
    is created by name (the driver already chose it), so all ranks run the same backend.
    ``ranks_on_machine`` ranks share this machine's cores (default: the whole group).
    """
    from platform_core.distributed.parallel_state import TPGroup

    backend = PluginManager().create(spec.config)
    if backend.device.type == "cpu":
        # Ranks share the machine's cores; oversubscribing them slows every matmul.
        sharing = ranks_on_machine or group.world_size
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // sharing))
    if isinstance(group, NodeGroupConfig):
        init_node_process_group(group, rank, backend.process_group_backend, while_waiting)
    else:
        init_loopback_process_group(group, rank, backend.process_group_backend, while_waiting)
    tp = TPGroup(rank=rank, size=group.world_size, communicator=backend.communicator(None))
    return ModelRunner(
        spec.config,
        backend,
        spec.model_dir,
        spec.hf_config,
        spec.dtype,
        spec.eos_token_ids,
        tp=tp,
    )
