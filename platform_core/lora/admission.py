"""Which LoRA adapters a front accepts: enabled, readable, within the limits, ids unambiguous."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from platform_core.config import LoRAConfig
from platform_core.errors import InvalidRequestError, LoRAAdapterError
from platform_core.lora.peft_adapter import AdapterConfig, inspect_adapter
from platform_core.lora_request import LoRARequest

#: How many inspected adapters are remembered (an inspection reads two small files).
INSPECTED_CAPACITY = 1024


class LoRAAdmission:
    """Checks each request's adapter before it is queued.

    An adapter is inspected (config and weight headers, no weights) once per id and path; the
    id must keep naming the same adapter (same name and path) for as long as it is remembered,
    because the prefix cache and the workers' adapter caches are keyed by it.
    """

    def __init__(self, config: LoRAConfig, hf_config: Any) -> None:
        self.config = config
        self._hf_config = hf_config
        self._inspected: OrderedDict[int, tuple[LoRARequest, AdapterConfig]] = OrderedDict()

    def check(self, request: LoRARequest | None) -> AdapterConfig | None:
        """The adapter's config; ``InvalidRequestError`` (``LoRAAdapterError`` for a bad
        adapter) when the request cannot run with it."""
        if request is None:
            return None
        if not self.config.enable_lora:
            raise InvalidRequestError(
                f"LoRA adapter {request.lora_name!r} requested, but LoRA is not enabled "
                "(start the engine with --enable-lora / enable_lora=True)",
                "lora_request",
            )
        known = self._inspected.get(request.lora_int_id)
        if known is not None:
            seen, adapter = known
            if (seen.lora_name, seen.lora_path) != (request.lora_name, request.lora_path):
                raise LoRAAdapterError(
                    f"lora_int_id {request.lora_int_id} already names adapter "
                    f"{seen.lora_name!r} at {seen.lora_path}; give {request.lora_name!r} "
                    "its own id",
                    "lora_request",
                )
            self._inspected.move_to_end(request.lora_int_id)
            return adapter
        adapter = inspect_adapter(request, self._hf_config, self.config.max_lora_rank)
        self._inspected[request.lora_int_id] = (request, adapter)
        if len(self._inspected) > INSPECTED_CAPACITY:
            self._inspected.popitem(last=False)
        return adapter
