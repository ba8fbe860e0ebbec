"""The backend plugin contract, version ``PLUGIN_API_VERSION``.

A backend distribution registers a module under the entry-point group ``platform_core.backends``;
that module implements the hooks below with ``@hookimpl``. Each hook returns objects, never import
strings.

Versioning: a backend states the ``(major, minor)`` API it implements in its ``BackendInfo``. It is
usable when the major versions match and its minor is not newer than the core's. A hook is
deprecated with a warning for one minor version before it is removed.

Hooks:
- ``platform_core_backend_info()``: describe the backend, available or not, with the reason. Must
  be cheap and must not initialise a device context (probe with counts, not allocations).
- ``platform_core_create_backend(name, config)``: build the ``Backend`` named ``name`` for an
  engine config, or return ``None`` when ``name`` is not this plugin's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from platform_core.config import EngineConfig
    from platform_core.plugins.interfaces import Backend, BackendInfo

PROJECT_NAME = "platform_core"
ENTRY_POINT_GROUP = "platform_core.backends"
# 1.1: Capabilities.auto_float32_dtype; 1.2: BackendInfo.details, Capabilities.auto_dtype_reason
PLUGIN_API_VERSION = (1, 2)

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def platform_core_backend_info() -> BackendInfo:
    """Describe this backend (one ``BackendInfo``), whether or not it can run here."""


@hookspec(firstresult=True)
def platform_core_create_backend(name: str, config: EngineConfig) -> Backend | None:
    """Create the backend ``name`` for ``config``; return ``None`` if ``name`` is not ours."""


def api_compatible(declared: tuple[int, int], core: tuple[int, int] = PLUGIN_API_VERSION) -> bool:
    """Whether a backend implementing ``declared`` can run on a core providing ``core``."""
    return declared[0] == core[0] and declared[1] <= core[1]
