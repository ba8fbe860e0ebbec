"""platform-core: a hardware-agnostic LLM inference and serving engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from platform_core.openmp_defaults import apply_openmp_defaults

__version__ = "0.1.0"

apply_openmp_defaults()  # before anything imports torch (see openmp_defaults)

if TYPE_CHECKING:
    from platform_core.engine.beam_search import BeamSearchParams
    from platform_core.entrypoints.llm import LLM
    from platform_core.lora_request import LoRARequest
    from platform_core.sampling_params import SamplingParams
    from platform_core.structured_outputs_params import StructuredOutputsParams

__all__ = [
    "LLM",
    "BeamSearchParams",
    "LoRARequest",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]


def __getattr__(name: str):
    # Lazy so that `import platform_core` (e.g. by a backend probe) does not import torch models.
    if name == "LLM":
        from platform_core.entrypoints.llm import LLM

        return LLM
    if name == "BeamSearchParams":
        from platform_core.engine.beam_search import BeamSearchParams

        return BeamSearchParams
    if name == "LoRARequest":
        from platform_core.lora_request import LoRARequest

        return LoRARequest
    if name == "SamplingParams":
        from platform_core.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from platform_core.structured_outputs_params import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(f"module 'platform_core' has no attribute {name!r}")
