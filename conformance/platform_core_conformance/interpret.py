"""The GPU backends' Triton kernels through the conformance suite on a CPU (``TRITON_INTERPRET=1``).

A GPU backend builds ``TritonAttentionOps`` with launch settings derived from its device's unit
count. Here the device is faked: the settings come from the backend's own ``*_launch_params``
function for a stated unit count, the tensors live on the host and Triton's interpreter runs the
kernels, so every commit certifies them in CPU CI. Only the checks that need no device of the
backend's type run (registration, kernels, KV blocks, ops); on a real GPU, ``platform-core
conformance --backend cuda`` runs the whole suite unchanged.

Run ``TRITON_INTERPRET=1 python -m platform_core_conformance.interpret cuda --report r.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from platform_core.backend_api import (
    AttentionOps,
    Backend,
    BackendInfo,
    Capabilities,
    EngineConfig,
    PluginManager,
    hookimpl,
)
from platform_core_conformance.runner import run_conformance

DEVICE_FREE_CHECKS = "test_registration or test_kernels or test_kv_blocks or test_ops"
SUFFIX = "-interpreted"


@dataclass(frozen=True, slots=True)
class FakedGpu:
    """Where a GPU backend's launch settings come from, and the unit count to feed them."""

    backend: str
    module: str
    launch_params: str
    units: int  # SMs, CUs or Xe-cores of a typical device


GPUS = {
    "cuda": FakedGpu("cuda", "platform_core_cuda.plugin", "cuda_launch_params", 132),
    "rocm": FakedGpu("rocm", "platform_core_rocm.plugin", "rocm_launch_params", 304),
    "xpu": FakedGpu("xpu", "platform_core_xpu.plugin", "xpu_launch_params", 64),
}


class InterpretedBackend(Backend):
    """The backend's Triton attention and layer ops on the host; nothing else of the GPU
    backend runs."""

    process_group_backend = "gloo"

    def __init__(self, name: str, capabilities: Capabilities, attention: AttentionOps) -> None:
        self.name = name
        self.device = torch.device("cpu")
        self.capabilities = capabilities
        self.attention = attention
        self.memory = None  # the device-free checks never profile

    def op_overrides(self) -> dict[str, Any]:
        from platform_core.backend_api import triton_op_overrides  # imports triton

        return triton_op_overrides()


@dataclass(frozen=True)
class InterpretedPlugin:
    """A plugin object exposing ``<gpu>-interpreted``, described by the real plugin's probe row."""

    gpu: FakedGpu
    row: BackendInfo

    @property
    def name(self) -> str:
        return self.gpu.backend + SUFFIX

    @hookimpl
    def platform_core_backend_info(self) -> BackendInfo:
        device = f"cpu (Triton interpreter; launch settings of {self.gpu.units} units)"
        return dataclasses.replace(
            self.row, name=self.name, available=True, reason="TRITON_INTERPRET=1", device=device
        )

    @hookimpl
    def platform_core_create_backend(self, name: str, config: EngineConfig) -> Backend | None:
        if name != self.name:
            return None
        from platform_core.backend_api import TritonAttentionOps  # imports triton

        launch = getattr(importlib.import_module(self.gpu.module), self.gpu.launch_params)
        attention = TritonAttentionOps(launch(self.gpu.units))
        assert self.row.capabilities is not None
        return InterpretedBackend(self.name, self.row.capabilities, attention)


def interpreted_plugin(backend: str) -> InterpretedPlugin:
    """The plugin for GPU backend ``backend``, from its installed probe row (capabilities)."""
    rows = {row.name: row for row in PluginManager().probe()}
    if backend not in rows or rows[backend].capabilities is None:
        raise SystemExit(f"backend {backend!r} is not installed or declares no capabilities")
    return InterpretedPlugin(GPUS[backend], rows[backend])


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: one GPU backend, the reports, an optional ``-k`` narrowing the checks."""
    from platform_core.backend_api import triton_interpreting

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("backend", choices=sorted(GPUS))
    parser.add_argument("--report", help="write the JSON report here")
    parser.add_argument("--junit", help="write the JUnit XML report here")
    parser.add_argument("-k", dest="keyword", help="further narrow the device-free checks")
    args = parser.parse_args(argv)
    if not triton_interpreting():
        parser.error("set TRITON_INTERPRET=1 in the environment (Triton reads it at import)")
    plugin = interpreted_plugin(args.backend)
    keyword = f"({DEVICE_FREE_CHECKS})" + (f" and ({args.keyword})" if args.keyword else "")
    return run_conformance(
        plugin.name,
        report=args.report,
        junit=args.junit,
        keyword=keyword,
        backend_plugins=[plugin],
    )


if __name__ == "__main__":
    raise SystemExit(main())
