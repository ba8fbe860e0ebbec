"""The backend plugin contract: the hooks a backend implements, and how the contract is versioned.

A backend distribution registers a module under the entry-point group ``platform_core.backends``;
that module (or any object registered with the plugin manager) implements the hooks below with
``@hookimpl``. Each hook's docstring is its contract. Hooks return objects, never import
strings. A backend imports what it needs from the core through :mod:`platform_core.backend_api`.

Versioning. ``PLUGIN_API_VERSION`` is ``(major, minor)``; a backend states the version it
implements in ``BackendInfo.api_version``.

- A minor version only adds (a hook, an optional field, a method with a default, a helper in the
  backend API), so a backend built for an older minor runs unchanged and what it does not set
  takes its default; ``platform-core backends`` and the conformance report note the older minor
  (:func:`api_note`).
- A backend declaring a newer minor than the core's, or another major, is listed unavailable
  with the side to update (:func:`api_compatible`).
- A hook is removed only by a new major, after at least one minor in which it is deprecated:
  its hookspec carries ``warn_on_impl=deprecated_hook(...)``, so registering a plugin that
  implements it issues a :class:`HookDeprecationWarning` at the plugin's function (Python shows
  it under pytest, so in the conformance suite, and with ``-W default``).

Dependency pins follow from these rules. platform-core keeps one plugin API major through a
release series ``0.N.*`` (before 1.0 the second digit is the breaking one); a new major comes
only with a new series. So a backend depends on ``platform-core>=0.N.M,<0.(N+1)``, ``0.N.M``
being the first release that provides the minor it declares: an exact pin would refuse the core
updates the rules promise are safe, and no upper bound would accept a core of another major.
(The conformance suite is released with the core and pins it exactly: it also checks engine
internals that the backend API does not cover.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from platform_core.config import EngineConfig
    from platform_core.plugins.interfaces import Backend, BackendInfo

PROJECT_NAME = "platform_core"
ENTRY_POINT_GROUP = "platform_core.backends"
# What each minor added (a backend declaring an older one gets the defaults):
# 1.1: Capabilities.auto_float32_dtype; 1.2: BackendInfo.details, Capabilities.auto_dtype_reason;
# 1.3: platform_core.backend_api, Backend.communicator defaults to torch.distributed;
# 1.4: Backend.before_step, the quantized_linear op (platform_core.quantization.formats);
# 1.5: the apply_token_bitmask op (platform_core.layers.token_bitmask);
# 1.6: the lora_shrink and lora_expand ops (platform_core.layers.lora);
# 1.7: AttentionOps.export_blocks / import_blocks (KV blocks in the canonical layout).
PLUGIN_API_VERSION = (1, 7)

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class HookDeprecationWarning(DeprecationWarning):
    """A plugin implements a hook that a later plugin API major removes."""


def deprecated_hook(name: str, since: tuple[int, int], instead: str) -> HookDeprecationWarning:
    """The ``warn_on_impl`` of hookspec ``name``, deprecated since plugin API ``since``."""
    version = format_api_version(since)
    return HookDeprecationWarning(
        f"hook {name} is deprecated since plugin API {version} and is removed in "
        f"{since[0] + 1}.0: {instead}"
    )


@hookspec
def platform_core_backend_info() -> BackendInfo:
    """Describe this plugin's backend: one ``BackendInfo``, whether or not it can run here.

    Called whenever backends are listed or chosen (``platform-core backends``, every engine
    start, ``backend="auto"``), in the serving process. It must be cheap and side-effect free:
    probe with counts and installed metadata (a driver present, a device count), never create a
    device context or allocate on a device.

    Return ``available=False`` with a ``reason`` the user can act on when the backend cannot run
    here, the ``capabilities`` it would declare when they are known, and in ``api_version`` the
    plugin API it implements. Raising is a bug of the plugin: it is listed unavailable with the
    exception as its reason, and the other backends are unaffected.
    """


@hookspec(firstresult=True)
def platform_core_create_backend(name: str, config: EngineConfig) -> Backend | None:
    """Build the ``Backend`` named ``name`` for an engine configured by ``config``.

    Called once per engine start (and once per tensor-parallel rank), and only on the plugin
    whose probe row is ``name`` after that row said it is available. It may initialise the
    device and take seconds; ``config`` may not yet hold the changes of the backend's own
    ``adjust_config``.

    Return the backend, or ``None`` when ``name`` is not this plugin's. Raise ``BackendError``
    (or ``ConfigError`` for a setting it cannot take) to refuse with a reason for the user, e.g.
    the device went away since the probe: a platform-core error reaches them as raised. Any other
    exception is a broken plugin: start-up fails with a ``BackendError`` naming the plugin,
    chained to the exception.
    """


def api_compatible(declared: tuple[int, int], core: tuple[int, int] = PLUGIN_API_VERSION) -> bool:
    """Whether a backend implementing ``declared`` can run on a core providing ``core``."""
    return declared[0] == core[0] and declared[1] <= core[1]


def api_note(declared: tuple[int, int]) -> str | None:
    """A note for a backend built for an older minor than the core's (it runs as is), else None."""
    if declared[0] == PLUGIN_API_VERSION[0] and declared[1] < PLUGIN_API_VERSION[1]:
        return (
            f"the plugin implements plugin API {format_api_version(declared)}, older than this "
            f"platform-core's {format_api_version(PLUGIN_API_VERSION)}: it runs unchanged; what "
            "later minor versions added (see platform_core/plugins/hookspecs.py) takes its defaults"
        )
    return None


def format_api_version(api: tuple[int, int]) -> str:
    """``"1.3"`` for ``(1, 3)``."""
    return ".".join(map(str, api))
