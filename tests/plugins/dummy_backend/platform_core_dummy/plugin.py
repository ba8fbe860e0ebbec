"""Hook implementations of the dummy backend: the reference ops, a fixed memory report.

It implements plugin API 1.0, older than the core's, to keep that case tested: it sets no field
later minors added and writes its own ``communicator()``, which 1.0 required.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from platform_core.backend_api import (
    Backend,
    BackendInfo,
    Capabilities,
    Communicator,
    ConfigAdjustment,
    EngineConfig,
    MemoryProfiler,
    MemoryReport,
    ReferenceAttentionOps,
    TorchDistributedCommunicator,
    hookimpl,
)

CAPABILITIES = Capabilities(dtypes=("float32",), head_sizes=(16, 32, 64), block_sizes=(8, 32))


class FixedMemoryProfiler(MemoryProfiler):
    """Pretends the device has 1 GiB, 512 MiB of it free."""

    def profile(self, run_dummy_forward: Callable[[], None], weights_bytes: int) -> MemoryReport:
        run_dummy_forward()
        return MemoryReport("dummy", 1 << 30, 1 << 29, weights_bytes, 1 << 20)


class DummyBackend(Backend):
    """Runs on the CPU with the reference attention; asks for block size 32 instead of 16."""

    def __init__(self) -> None:
        self.name = "dummy"
        self.device = torch.device("cpu")
        self.capabilities = CAPABILITIES
        self.attention = ReferenceAttentionOps()
        self.memory = FixedMemoryProfiler()

    def communicator(self, group: Any = None) -> Communicator:
        return TorchDistributedCommunicator(group=group, device=self.device)

    def adjust_config(self, config: EngineConfig) -> list[ConfigAdjustment]:
        if config.cache.block_size == 16:
            return [ConfigAdjustment("block_size", 32, "the dummy device prefers 32-token blocks")]
        return []


@hookimpl
def platform_core_backend_info() -> BackendInfo:
    return BackendInfo(
        name="dummy",
        package="platform-core-dummy-backend",
        version="0.0.1",
        api_version=(1, 0),
        available=True,
        reason="test backend",
        priority=-10,
        device="cpu (reference ops)",
        capabilities=CAPABILITIES,
    )


@hookimpl
def platform_core_create_backend(name: str, config: EngineConfig) -> Backend | None:
    return DummyBackend() if name == "dummy" else None
