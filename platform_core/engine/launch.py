"""Starting the engine a front serves: ``start_engine`` (one core, or data-parallel replicas).

``process`` (``serve``'s default) runs each engine core in its own process (``ProcessEngine``);
``thread`` runs it on a thread of this process (``AsyncEngine``).
"""

from __future__ import annotations

import functools

from platform_core.config import EngineConfig
from platform_core.engine import ENGINE_MODES
from platform_core.engine.async_engine import AsyncEngine
from platform_core.engine.core import EngineSetup
from platform_core.engine.data_parallel import DataParallelEngine
from platform_core.engine.process_engine import ProcessEngine
from platform_core.engine.request_stream import SubmitFront
from platform_core.errors import ConfigError


def start_engine(
    config: EngineConfig, mode: str = "process", engine_setup: EngineSetup | None = None
) -> SubmitFront:
    """The engine for ``config`` in ``mode``; with ``data_parallel_size > 1``, that many
    replicas behind a ``DataParallelEngine``. ``engine_setup`` is applied to each engine once
    built (picklable in process mode)."""
    if mode not in ENGINE_MODES:
        raise ConfigError(f"engine mode must be one of {ENGINE_MODES}, got {mode!r}")
    start = ProcessEngine.from_config if mode == "process" else AsyncEngine.from_config
    start = functools.partial(start, engine_setup=engine_setup)
    if config.parallel.data_parallel_size > 1:
        return DataParallelEngine.from_config(config, start)
    return start(config)
