"""One-token steps of the CPU backend replayed from a TorchScript trace of the model's forward.

At batch 1 a decode step of a 30-layer model runs some 400 small ops, and the Python between
them (module calls, op wrappers, dispatch) cost about 2 of a 14 ms step on SmolLM2
(``benchmarks/RESULTS.md``). A trace of the forward records the same ops once and replays them
from C++. One trace per token count in ``sizes``; other steps run eagerly. Only one-token steps
are traced by default: larger ones go through oneDNN's packed weights, which a trace cannot hold
(tracing fails; a size whose trace fails runs eagerly, logged), and their Python is a smaller
share of a longer step.

Why a trace is valid for every step of its token count: on the compiled path each op decides
from tensor shapes and the metadata *tensors* at run time (the kernels read the sequences from
``query_start_loc``, ``seq_lens`` and the block tables), so nothing about a step's sequences is
fixed by tracing except the block tables' width, which is padded to ``max_blocks``. The one
Python decision the trace fixes is the linear's one-row test, which depends only on the token
count. Any other conversion of a traced value to Python (a ``TracerWarning``) means the forward
decides something from data, and that size then runs eagerly (logged).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch

from platform_core.backend_api import AttentionMetadata

logger = logging.getLogger("platform_core_cpu")

GRAPHS_ENV = "PLATFORM_CORE_CPU_GRAPHS"
TRACED_SIZES = (1,)


class _Forward(torch.nn.Module):
    """The model's forward over one step's tensors, with the metadata rebuilt inside."""

    def __init__(
        self, model: Callable[..., torch.Tensor], kv_caches: list[torch.Tensor], block_size: int
    ) -> None:
        super().__init__()
        self._model = model
        self._kv_caches = kv_caches
        self._block_size = block_size

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        # The Python-side fields only serve the torch fallback, which never runs traced.
        metadata = AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            max_query_len=0,
            max_seq_len=0,
            block_size=self._block_size,
            query_start_loc_cpu=[],
            seq_lens_cpu=[],
        )
        return self._model(input_ids, positions, self._kv_caches, metadata)


class CpuGraphRunner:
    """A stand-in for ``model``'s forward (same signature): steps of a traced token count
    replay their trace, the others run ``model`` eagerly.

    ``capture`` must run once before use; it runs each traced size once on dummy inputs whose
    slots are all ``-1``, so the cache is not written.
    """

    def __init__(
        self,
        model: Callable[..., torch.Tensor],
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_blocks: int,
        sizes: tuple[int, ...] = TRACED_SIZES,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.sizes = sizes
        self.traces: dict[int, Any] = {}
        self.replays = 0  # steps served by a trace (for tests and logs)

    @torch.inference_mode()
    def capture(self) -> None:
        """Trace the forward at every size in ``sizes``."""
        forward = _Forward(self.model, self.kv_caches, self.block_size)
        for size in self.sizes:
            inputs = (
                torch.zeros(size, dtype=torch.int64),
                torch.zeros(size, dtype=torch.int64),
                torch.arange(size + 1, dtype=torch.int32),
                torch.ones(size, dtype=torch.int32),
                torch.zeros(size, self.max_blocks, dtype=torch.int32),
                torch.full((size,), -1, dtype=torch.int64),
            )
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", torch.jit.TracerWarning)
                # The one expected decision: a single activation row takes the GEMV.
                warnings.filterwarnings(
                    "ignore", category=torch.jit.TracerWarning, module="platform_core_cpu.linear"
                )
                try:
                    trace = torch.jit.trace(forward, inputs, check_trace=False)
                except RuntimeError as exc:
                    logger.info("CPU graphs: steps of %d tokens run eagerly (%s)", size, exc)
                    continue
            data_dependent = [w for w in caught if issubclass(w.category, torch.jit.TracerWarning)]
            if data_dependent:
                logger.warning(
                    "CPU graphs: steps of %d tokens run eagerly (the forward reads data in "
                    "Python: %s)",
                    size,
                    data_dependent[0].message,
                )
                continue
            self.traces[size] = trace
        logger.info("CPU graphs: traced steps of %s tokens", sorted(self.traces))

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        trace = self.traces.get(input_ids.shape[0])
        tables = metadata.block_tables
        if trace is None or tables.shape[1] > self.max_blocks or kv_caches is not self.kv_caches:
            return self.model(input_ids, positions, kv_caches, metadata)
        padded = tables.new_zeros(tables.shape[0], self.max_blocks)
        padded[:, : tables.shape[1]] = tables
        self.replays += 1
        return trace(
            input_ids,
            positions,
            metadata.query_start_loc,
            metadata.seq_lens,
            padded,
            metadata.slot_mapping,
        )
