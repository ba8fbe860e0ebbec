"""The scheduler's counters since start: steps, tokens, preemptions and draft verification."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

# Upper bounds (tokens) of the step-size histogram: powers of two up to a large token budget,
# the bounds vLLM's ``vllm:iteration_tokens_total`` uses, so both exports share one count.
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(slots=True)
class SchedulerStats:
    """Counters since start; ``spec_*`` count verification steps and the drafts they judged."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_scheduled_tokens: int = 0
    max_batch_size: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verifications: int = 0
    # Steps per ``STEP_TOKEN_BUCKETS`` bound (not cumulative); the last slot: above every bound.
    step_token_counts: list[int] = field(
        default_factory=lambda: [0] * (len(STEP_TOKEN_BUCKETS) + 1)
    )

    def record_step(self, num_tokens: int, batch_size: int) -> None:
        """Count one scheduled step of ``num_tokens`` tokens over ``batch_size`` requests."""
        self.num_steps += 1
        self.num_scheduled_tokens += num_tokens
        self.step_token_counts[bisect_left(STEP_TOKEN_BUCKETS, num_tokens)] += 1
        if batch_size > self.max_batch_size:
            self.max_batch_size = batch_size

    def record_verification(self, num_drafts: int, num_rejected: int) -> None:
        """Count one request's verified drafts."""
        self.spec_verifications += 1
        self.spec_proposed_tokens += num_drafts
        self.spec_accepted_tokens += num_drafts - num_rejected

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / max(1, self.spec_proposed_tokens)

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens produced per verification: accepted drafts plus the target's own token."""
        return (self.spec_accepted_tokens + self.spec_verifications) / max(
            1, self.spec_verifications
        )
