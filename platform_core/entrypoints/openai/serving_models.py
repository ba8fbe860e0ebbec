"""The models a server answers to, as vLLM serves them: the base model under its served name and
each LoRA adapter under its own name (``--lora-modules`` at start, ``POST /v1/load_lora_adapter``
and ``/v1/unload_lora_adapter`` at run time).

A request's ``model`` picks its adapter (``ServedModels.resolve``). Every adapter gets a new
``lora_int_id`` (1, 2, ...), never reused while the server runs: the engine's adapter caches and
prefix-cache keys are keyed by it, so an adapter unloaded and loaded again (perhaps with new
weights at the same path) is never mistaken for the old one. Adapters are checked here, against
the model's config and ``--max-lora-rank``, before any request can name them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from platform_core.config import EngineConfig
from platform_core.entrypoints.openai.errors import LoRANotFoundError, ModelNotFoundError
from platform_core.entrypoints.openai.lora_modules import LoRAModulePath
from platform_core.errors import ConfigError, InvalidRequestError
from platform_core.lora.admission import LoRAAdmission
from platform_core.lora_request import LoRARequest

logger = logging.getLogger("platform_core.server")


class ServedModels:
    """The base model's served name and the LoRA adapters served beside it.

    ``admission`` checks adapters (``None``: LoRA is not enabled, so none can be added).
    Without ``runtime_updates`` (several API servers, each with its own list) adapters are only
    added at start, so that every API server serves the same ones.
    """

    def __init__(
        self,
        base_name: str,
        admission: LoRAAdmission | None = None,
        runtime_updates: bool = True,
    ) -> None:
        self.base_name = base_name
        self._admission = admission
        self._runtime_updates = runtime_updates
        self._adapters: dict[str, LoRARequest] = {}
        self._last_id = 0
        self._updating = asyncio.Lock()

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names: ``None`` for the base model (or no name);
        ``ModelNotFoundError`` (404) for a name served neither way."""
        if model is None or model == self.base_name:
            return None
        lora = self._adapters.get(model)
        if lora is None:
            raise ModelNotFoundError(model)
        return lora

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Check the adapter at ``path`` and serve it as ``name``; ``InvalidRequestError``
        (400) if it cannot be."""
        lora = self._checked(name, path, base_model_name)
        self._adapters[name] = lora
        return lora

    async def load(self, name: str, path: str) -> LoRARequest:
        """``add`` for ``/v1/load_lora_adapter``: the files are read on a worker thread, one
        load at a time."""
        self._check_runtime_update()
        async with self._updating:
            lora = await asyncio.to_thread(self._checked, name, path, None)
            self._adapters[name] = lora
        logger.info("LoRA adapter %r loaded from %s (id %d)", name, path, lora.lora_int_id)
        return lora

    def unload(self, name: str | None, lora_int_id: int | None) -> LoRARequest:
        """Stop serving the adapter with this name and/or id; ``LoRANotFoundError`` (404) if
        none is served. Requests already accepted keep running with it."""
        self._check_runtime_update()
        for lora in self._adapters.values():
            if name in (None, lora.lora_name) and lora_int_id in (None, lora.lora_int_id):
                del self._adapters[lora.lora_name]
                logger.info("LoRA adapter %r unloaded", lora.lora_name)
                return lora
        what = [] if name is None else [repr(name)]
        if lora_int_id is not None:
            what.append(f"with lora_int_id {lora_int_id}")
        raise LoRANotFoundError(" ".join(what))

    def cards(self, created: int, max_model_len: int) -> list[dict[str, Any]]:
        """``/v1/models``' entries: the base model, then each adapter (``root``: its path,
        ``parent``: the model it adapts)."""
        base = {
            "id": self.base_name,
            "object": "model",
            "created": created,
            "owned_by": "platform-core",
            # Not the model's directory: that would tell any client the layout of the disk.
            "root": self.base_name,
            "parent": None,
            "max_model_len": max_model_len,
        }
        adapters = [
            {
                **base,
                "id": lora.lora_name,
                "root": lora.lora_path,
                "parent": lora.base_model_name or self.base_name,
            }
            for lora in self._adapters.values()
        ]
        return [base, *adapters]

    def _check_runtime_update(self) -> None:
        if self._admission is None:
            raise _not_enabled()
        if not self._runtime_updates:
            raise InvalidRequestError(
                "LoRA adapters cannot be loaded or unloaded at run time with several API "
                "servers (--api-server-count > 1: each keeps its own list); serve them with "
                "--lora-modules",
                "lora_name",
            )

    def _checked(self, name: str, path: str, base_model_name: str | None) -> LoRARequest:
        """The request for a new adapter, with the next id, once it passed every check."""
        if self._admission is None:
            raise _not_enabled()
        if name == self.base_name:
            raise InvalidRequestError(
                f"{name!r} is the base model's name; give the adapter another", "lora_name"
            )
        if name in self._adapters:
            raise InvalidRequestError(
                f"a LoRA adapter named {name!r} is already served; choose another name (or "
                "unload it first)",
                "lora_name",
            )
        self._last_id += 1  # spent even if the checks below fail: ids are never reused
        lora = LoRARequest(name, self._last_id, path, base_model_name or self.base_name)
        try:
            self._admission.check(lora)
        except InvalidRequestError as exc:
            exc.param = "lora_path"
            raise
        return lora


def _not_enabled() -> InvalidRequestError:
    return InvalidRequestError(
        "LoRA is not enabled on this server (start it with --enable-lora)", "lora_name"
    )


def served_models(
    config: EngineConfig,
    name: str,
    modules: Sequence[LoRAModulePath] = (),
    runtime_updates: bool = True,
) -> ServedModels:
    """The models a server for ``config`` serves as ``name``, with the ``--lora-modules``
    adapters (ids 1, 2, ... in order), each checked now: ``ConfigError`` for one that cannot be
    served, or for adapters without ``enable_lora``.

    With LoRA enabled, the model's config is read here (no weights), so adapters are checked
    in this process even when the engine core runs in another.
    """
    if not config.lora.enable_lora:
        if modules:
            raise ConfigError("--lora-modules needs --enable-lora")
        return ServedModels(name)
    from platform_core.models.hf_files import load_hf_config
    from platform_core.models.resolve import resolve_model_path

    model_dir = resolve_model_path(config.model.model)
    hf_config = load_hf_config(model_dir, config.model.trust_remote_code)
    models = ServedModels(name, LoRAAdmission(config.lora, hf_config), runtime_updates)
    for module in modules:
        try:
            models.add(module.name, module.path, module.base_model_name)
        except InvalidRequestError as exc:
            raise ConfigError(f"--lora-modules {module.name}={module.path}: {exc}") from exc
    return models
