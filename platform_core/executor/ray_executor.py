"""Tensor-parallel ranks as Ray actors placed by a placement group.

``ray_address`` joins an existing cluster (``ray start --head ...``, nodes joined with
``ray start --address ...``); without it a local cluster is started on a loopback node address
(Ray rewrites 127.0.0.1 to the machine's interface address, so 127.0.0.2 is used unless
``PLATFORM_CORE_RAY_NODE_IP`` says otherwise). The driver is rank 0 and the group's rendezvous,
on the driver's Ray node address; the other ranks take one CPU bundle each of a ``PACK``
placement group, so they stay on the fewest nodes and spill onto other nodes when the driver's
lacks room. Every node needs the same model directory and installed packages.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from platform_core.distributed.launch import NodeGroupConfig, find_free_port
from platform_core.executor.base import (
    LockstepExecutor,
    ModelSpec,
    WorkerDiedError,
    destroy_process_group,
)
from platform_core.executor.messages import RankCall, serve_call

logger = logging.getLogger("platform_core.executor")

DEFAULT_NODE_IP = "127.0.0.2"


class RayRank:
    """One worker rank inside a Ray actor: placed first, then built (``build``)."""

    def __init__(self) -> None:
        self.runner: Any = None

    def place(self) -> tuple[str, int]:
        """This actor's node address and process id (also a liveness probe)."""
        import ray

        return ray.util.get_node_ip_address(), os.getpid()

    def build(self, spec: ModelSpec, group: NodeGroupConfig, rank: int, ranks_here: int) -> None:
        """Join the group as ``rank`` and load this rank's shard (``ranks_here`` ranks share
        this node's cores)."""
        from platform_core.executor.rank import build_rank_runner

        self.runner = build_rank_runner(spec, group, rank, ranks_on_machine=ranks_here)

    def call(self, call: RankCall) -> Any:
        """Run one typed call on this rank."""
        return serve_call(self.runner, call)


class RayExecutor(LockstepExecutor):
    """``tensor_parallel_size`` ranks: the driver plus Ray actors."""

    def __init__(self, spec: ModelSpec) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from platform_core.executor.rank import build_rank_runner

        parallel = spec.config.parallel
        self.timeout = parallel.worker_timeout_s
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            if parallel.ray_address:
                ray.init(address=parallel.ray_address, log_to_driver=False)
            else:
                ray.init(
                    address="local",  # a new cluster, never one another ray.init left running
                    _node_ip_address=os.environ.get("PLATFORM_CORE_RAY_NODE_IP", DEFAULT_NODE_IP),
                    include_dashboard=False,
                    log_to_driver=False,
                )
        world = parallel.tensor_parallel_size
        host = ray.util.get_node_ip_address()
        group = NodeGroupConfig(world, host, find_free_port(host), parallel.worker_timeout_s)
        self._pg = placement_group([{"CPU": 1}] * (world - 1), strategy="PACK")
        ray.get(self._pg.ready(), timeout=self.timeout)
        remote_rank = ray.remote(num_cpus=1)(RayRank)
        self._actors = [
            remote_rank.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=rank - 1
                )
            ).remote()
            for rank in range(1, world)
        ]
        self._pending: list[Any] = []
        try:
            places = ray.get([a.place.remote() for a in self._actors], timeout=self.timeout)
            nodes = [host] + [node for node, _ in places]
            built = [
                actor.build.remote(spec, group, rank, nodes.count(nodes[rank]))
                for rank, actor in enumerate(self._actors, start=1)
            ]

            def fail_with_a_rank() -> None:
                """Re-raise a rank's start-up error while the driver waits for the group."""
                finished, _ = ray.wait(built, num_returns=len(built), timeout=0)
                ray.get(finished)

            self.driver = build_rank_runner(
                spec, group, 0, fail_with_a_rank, ranks_on_machine=nodes.count(host)
            )
            ray.get(built, timeout=self.timeout)
        except BaseException:
            self.shutdown()
            raise
        self.worker_nodes = nodes[1:]
        self.worker_pids = [pid for _, pid in places]
        logger.info(
            "tensor parallel: %d ranks (driver on %s, Ray actors on %s)",
            world,
            host,
            ", ".join(self.worker_nodes),
        )

    def _send(self, call: RankCall) -> None:
        self._pending = [actor.call.remote(call) for actor in self._actors]

    def _gather(self) -> list[Any]:
        import ray

        pending, self._pending = self._pending, []
        try:
            return ray.get(pending, timeout=self.timeout)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            raise WorkerDiedError(f"a Ray worker failed: {exc}") from exc

    def check_health(self) -> None:
        import ray

        try:
            ray.get([a.place.remote() for a in self._actors], timeout=5)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            raise WorkerDiedError(f"a Ray worker is gone: {exc}") from exc

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        destroy_process_group()
        for actor in getattr(self, "_actors", []):
            ray.kill(actor)
        self._actors = []
        if getattr(self, "_pg", None) is not None:
            remove_placement_group(self._pg)
            self._pg = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
