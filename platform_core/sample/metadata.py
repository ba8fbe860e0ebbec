"""Per-step sampling parameters of the batch, gathered into tensors once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from platform_core.scheduler.output import ScheduledRequest


@dataclass(slots=True)
class SamplingMetadata:
    """Row ``i`` describes the ``i``-th sampled request of the step.

    ``generators[i]`` is the request's own generator when it has a seed, else ``None`` (the
    engine-wide generator is used).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    all_greedy: bool
    needs_top_k: bool
    needs_top_p: bool
    greedy_rows: torch.Tensor
    generators: list[torch.Generator | None]


class GeneratorStore:
    """One ``torch.Generator`` per seeded request, created on first use and dropped on finish."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def get(self, request: ScheduledRequest) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None:
            return None
        generator = self._generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator()
            generator.manual_seed(seed)
            self._generators[request.request_id] = generator
        return generator

    def drop(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._generators.pop(request_id, None)


def build_sampling_metadata(
    requests: list[ScheduledRequest], generators: GeneratorStore, device: torch.device
) -> SamplingMetadata:
    """Collect the sampled requests' parameters into tensors on ``device``."""
    params = [r.sampling_params for r in requests]
    greedy = [p.greedy for p in params]
    temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    return SamplingMetadata(
        temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
        top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
        top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
        all_greedy=all(greedy),
        needs_top_k=any(k > 0 and not g for k, g in zip(top_k, greedy)),
        needs_top_p=any(p < 1.0 and not g for p, g in zip(top_p, greedy)),
        greedy_rows=torch.tensor(greedy, dtype=torch.bool, device=device),
        generators=[None if g else generators.get(r) for r, g in zip(requests, greedy)],
    )
