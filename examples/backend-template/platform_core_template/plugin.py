"""The template backend's hooks: what platform-core calls to find and build the backend.

Copy this package, rename ``template``/``platform_core_template``, then replace the parts marked
below with your device's: the attention ops (keep the reference as the oracle in your tests),
the memory profiler, the process-group backend and the capabilities you have tested.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch

from platform_core.attention.reference import ReferenceAttentionOps
from platform_core.config import EngineConfig
from platform_core.distributed.communicator import Communicator, TorchDistributedCommunicator
from platform_core.plugins.hookspecs import hookimpl
from platform_core.plugins.interfaces import Backend, BackendInfo, Capabilities
from platform_core_template.memory import HostMemoryProfiler

NAME = "template"
DISTRIBUTION = "platform-core-backend-template"
API_VERSION = (1, 0)  # the plugin contract this package implements
# Declare only what passes `platform-core conformance --backend template`.
CAPABILITIES = Capabilities(
    dtypes=("float32", "bfloat16"),
    head_sizes=(16, 32, 64, 128),
    block_sizes=(8, 16, 32),
    features=("prefix_caching", "chunked_prefill"),
)


def _version() -> str:
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown (not installed)"


class TemplateBackend(Backend):
    """Runs on the CPU with the pure-torch reference attention (correct, slow)."""

    # The torch.distributed backend the conformance suite starts for the collectives.
    process_group_backend = "gloo"

    def __init__(self) -> None:
        self.name = NAME
        self.device = torch.device("cpu")  # yours: torch.device("<your device type>")
        self.capabilities = CAPABILITIES
        self.attention = ReferenceAttentionOps()  # yours: your paged-attention kernels
        self.memory = HostMemoryProfiler()  # yours: your allocator's statistics

    def communicator(self, group: Any = None) -> Communicator:
        return TorchDistributedCommunicator(group=group, device=self.device)


@hookimpl
def platform_core_backend_info() -> BackendInfo:
    # Cheap and side-effect free: probe for the device (a count, a driver check), do not use it.
    return BackendInfo(
        name=NAME,
        package=DISTRIBUTION,
        version=_version(),
        api_version=API_VERSION,
        available=True,
        reason="runs anywhere (reference attention on the CPU)",
        priority=-20,  # below real backends, so "auto" never picks the template
        device="cpu (reference ops)",
        capabilities=CAPABILITIES,
    )


@hookimpl
def platform_core_create_backend(name: str, config: EngineConfig) -> Backend | None:
    return TemplateBackend() if name == NAME else None
