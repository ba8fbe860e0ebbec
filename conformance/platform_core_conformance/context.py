"""The backend under test: found through platform-core's plugin manager, described for reports."""

from __future__ import annotations

import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from platform_core.backend_api import (
    PLUGIN_API_VERSION,
    Backend,
    BackendInfo,
    Capabilities,
    EngineConfig,
    PluginManager,
    api_note,
    format_api_version,
    installed_version,
)
from platform_core_conformance.tolerances import tolerance_for


def backend_manager(extra_plugins: Sequence[object] = ()) -> PluginManager:
    """The installed backend plugins plus ``extra_plugins`` (registered objects)."""
    manager = PluginManager()
    for index, plugin in enumerate(extra_plugins):
        manager.register(plugin, name=f"conformance-extra-{index}")
    return manager


def create_backend(name: str, extra_plugins: Sequence[object] = ()) -> tuple[BackendInfo, Backend]:
    """Probe and build backend ``name``; ``BackendError`` says why when it cannot."""
    manager = backend_manager(extra_plugins)
    info = manager.choose(name)
    return info, manager.create(EngineConfig.from_flat(backend=info.name))


def environment() -> dict[str, str]:
    """The versions every report names, whether or not the backend could be built."""
    return {
        "platform_core_version": installed_version("platform-core"),
        "plugin_api_version": format_api_version(PLUGIN_API_VERSION),
        "conformance_version": installed_version("platform-core-conformance"),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
    }


@dataclass(frozen=True)
class ConformanceContext:
    """One conformance run: the backend's probe row and the backend object the checks use.

    ``extra_plugins`` travel to the processes that the collective checks spawn.
    """

    info: BackendInfo
    backend: Backend
    extra_plugins: tuple[object, ...] = ()

    @classmethod
    def create(cls, name: str, extra_plugins: Sequence[object] = ()) -> ConformanceContext:
        """Build the context of backend ``name``; raises ``BackendError`` if it is unusable."""
        info, backend = create_backend(name, extra_plugins)
        return cls(info, backend, tuple(extra_plugins))

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def capabilities(self) -> Capabilities:
        return self.backend.capabilities

    @cached_property
    def op_overrides(self) -> dict[str, Callable[..., Any]]:
        """The backend's op overrides (asked once per run)."""
        return dict(self.backend.op_overrides())

    def header(self) -> dict[str, Any]:
        """What every report starts with: who was tested, on what, against which versions."""
        caps = self.capabilities
        return {
            "backend": self.name,
            "backend_package": self.info.package,
            "backend_version": self.info.version,
            "backend_api_version": format_api_version(self.info.api_version),
            "api_note": api_note(self.info.api_version),
            "device": self.info.device,
            "torch_device": str(self.backend.device),
            **environment(),
            "capabilities": {
                "dtypes": list(caps.dtypes),
                "head_sizes": list(caps.head_sizes),
                "block_sizes": list(caps.block_sizes),
                "max_batch": caps.max_batch,
                "features": list(caps.features),
            },
            "tolerances": {dtype: tolerance_for(dtype).as_dict() for dtype in caps.dtypes},
        }
