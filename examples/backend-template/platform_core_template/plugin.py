"""The template backend's hooks: what platform-core calls to find and build the backend.

Copy this package, rename ``template``/``platform_core_template``, then replace the parts marked
below with your device's: the attention ops (keep the reference as the oracle in your tests),
the memory profiler, the process-group backend and the capabilities you have tested.
"""

from __future__ import annotations

import torch

from platform_core.backend_api import (
    Backend,
    BackendIdentity,
    BackendInfo,
    Capabilities,
    EngineConfig,
    ReferenceAttentionOps,
    hookimpl,
    installed_version,
)
from platform_core_template.memory import HostMemoryProfiler

# api_version: the plugin contract this package implements (PLUGIN_API_VERSION when written);
# priority: below real backends, so "auto" never picks the template.
BACKEND = BackendIdentity(
    "template", "platform-core-backend-template", api_version=(1, 4), priority=-20
)
# Declare only what passes `platform-core conformance --backend template`.
CAPABILITIES = Capabilities(
    dtypes=("float32", "bfloat16"),
    head_sizes=(16, 32, 64, 128),
    block_sizes=(8, 16, 32),
    features=("prefix_caching", "chunked_prefill"),
)


class TemplateBackend(Backend):
    """Runs on the CPU with the pure-torch reference attention (correct, slow)."""

    # The torch.distributed backend of the collectives (the default communicator runs on it;
    # override communicator() only for collectives outside torch.distributed).
    process_group_backend = "gloo"

    def __init__(self) -> None:
        self.name = BACKEND.name
        self.device = torch.device("cpu")  # yours: torch.device("<your device type>")
        self.capabilities = CAPABILITIES
        self.attention = ReferenceAttentionOps()  # yours: your paged-attention kernels
        self.memory = HostMemoryProfiler()  # yours: your allocator's statistics


@hookimpl
def platform_core_backend_info() -> BackendInfo:
    # Cheap and side-effect free: probe for the device (a count, a driver check), do not use it;
    # pass problem="why not, and what to do" when it cannot run here.
    return BACKEND.row(
        installed_version(BACKEND.package),
        CAPABILITIES,
        device="cpu (reference ops)",
        problem=None,
        ready="runs anywhere (reference attention on the CPU)",
    )


@hookimpl
def platform_core_create_backend(name: str, config: EngineConfig) -> Backend | None:
    return TemplateBackend() if name == BACKEND.name else None
