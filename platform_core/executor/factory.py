"""Choosing the executor the parallel config asks for."""

from __future__ import annotations

from platform_core.errors import ConfigError
from platform_core.executor.base import Executor, ModelSpec, UniprocExecutor
from platform_core.plugins.interfaces import Backend


def make_executor(spec: ModelSpec, backend: Backend) -> Executor:
    """A uniprocess, multiprocess or Ray executor for ``spec.config.parallel``."""
    parallel = spec.config.parallel
    kind = parallel.executor
    if spec.config.speculative.speculative_method == "draft" and parallel.tensor_parallel_size > 1:
        raise ConfigError("draft-model speculation runs with tensor_parallel_size=1 only")
    if kind == "uni":
        if parallel.tensor_parallel_size != 1:
            raise ConfigError(
                "distributed_executor_backend='uni' runs one rank; use 'mp' or 'ray' for "
                f"tensor_parallel_size={parallel.tensor_parallel_size}"
            )
        return UniprocExecutor(spec, backend)
    if kind == "mp":
        from platform_core.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(spec)
    from platform_core.executor.ray_executor import RayExecutor

    return RayExecutor(spec)
