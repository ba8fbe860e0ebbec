"""Which LoRA adapter a request runs with (``from platform_core import LoRARequest``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``).

    ``lora_int_id`` (>= 1) identifies the adapter's weights everywhere: in the engine's caches of
    loaded adapters and in the prefix-cache keys, so two different adapters must never share an
    id. ``base_model_name`` is the model it was trained on, as ``/v1/models`` shows it.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise ValueError(f"lora_int_id must be an int, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
        if not self.lora_path:
            raise ValueError("lora_path must not be empty")

    @property
    def cache_key(self) -> str:
        """What prefix-cache hashes of this adapter's requests are keyed by."""
        return f"lora:{self.lora_int_id}:{self.lora_path}"
