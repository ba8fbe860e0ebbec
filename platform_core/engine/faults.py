"""Test-only fault injection: make chosen requests fail at chosen stages.

The engine calls ``check(stage, request_ids)`` at each stage; a rule matching one of the ids
raises ``InjectedFault`` there. Production engines have no injector (``None``): zero cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STAGES = ("execute", "postprocess")


class InjectedFault(RuntimeError):
    """The failure a fault rule produces."""


@dataclass
class FaultInjector:
    """Rules: request id -> stage at which that request fails; ``every`` fails all at a stage."""

    rules: dict[str, str] = field(default_factory=dict)
    every: str | None = None

    def fail(self, request_id: str, stage: str) -> None:
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; stages: {STAGES}")
        self.rules[request_id] = stage

    def check(self, stage: str, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if self.rules.get(request_id) == stage or self.every == stage:
                raise InjectedFault(f"injected fault for {request_id} at {stage}")
