"""The driver's half of a step: turn the step's logits into tokens, logprobs and verdicts."""

from __future__ import annotations

import torch

from platform_core.layers.argmax import ArgmaxFn, row_argmax
from platform_core.layers.token_bitmask import TokenBitmaskFn, apply_token_bitmask
from platform_core.sample.draft_verify import DraftGroup, verify
from platform_core.sample.metadata import GeneratorStore, SampleRow, build_sampling_metadata
from platform_core.sample.sampler import Sampler, compute_logprobs
from platform_core.scheduler.output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from platform_core.worker.step_plan import StepPlan


class StepSampler:
    """Samples (and verifies drafts) for the requests of a step; owns per-request generators."""

    def __init__(
        self,
        seed: int,
        eos_token_ids: frozenset[int],
        argmax: ArgmaxFn = row_argmax,
        apply_bitmask: TokenBitmaskFn = apply_token_bitmask,
    ) -> None:
        generator = torch.Generator()
        generator.manual_seed(seed)
        self.sampler = Sampler(generator, argmax, apply_bitmask)
        self.generators = GeneratorStore()
        self.eos_token_ids = eos_token_ids

    def __call__(
        self, output: SchedulerOutput, plan: StepPlan, logits: torch.Tensor
    ) -> ModelRunnerOutput:
        """``logits`` holds one row per ``plan.logits_rows`` entry."""
        self.generators.drop(output.finished_ids)
        result = ModelRunnerOutput()
        sample_rows = plan.batch.sample_rows
        scheduled = output.scheduled
        requests = (
            scheduled
            if len(sample_rows) == len(scheduled)  # every request samples (decodes)
            else [scheduled[i] for i in sample_rows]
        )
        if requests:
            self._sample(requests, logits[: plan.num_sample_rows], result)
        for rows in plan.prompt_rows:
            request = output.scheduled[rows.request_index]
            targets = request.prompt_token_ids[rows.first_target : rows.first_target + rows.count]
            block = logits[rows.offset : rows.offset + rows.count]
            chosen = torch.tensor(targets, device=block.device)
            counts = [request.sampling_params.prompt_logprobs] * rows.count
            entries = compute_logprobs(block, chosen, counts)
            result.prompt_logprobs[request.request_id] = (rows.first_target, entries)
        return result

    def _sample(
        self, requests: list[ScheduledRequest], logits: torch.Tensor, result: ModelRunnerOutput
    ) -> None:
        """Sample every request's next token(s): forks share a row, drafts are verified."""
        if any(r.num_draft_tokens or r.fork_ids for r in requests):
            self._sample_forks_and_drafts(requests, logits, result)
            return
        # One logits row per request, one token each: the requests are the rows.
        meta = build_sampling_metadata(requests, self.generators, self.eos_token_ids, logits.device)
        sampled = self.sampler(logits, meta)
        result.sampled = {r.request_id: [t] for r, t in zip(requests, sampled.token_ids)}
        if meta.max_logprobs >= 0:
            for request, entry in zip(requests, sampled.logprobs):
                if entry is not None:
                    result.logprobs[request.request_id] = [entry]

    def _sample_forks_and_drafts(
        self, requests: list[ScheduledRequest], logits: torch.Tensor, result: ModelRunnerOutput
    ) -> None:
        rows: list[SampleRow] = []
        logits_rows: list[int] = []
        groups: list[DraftGroup] = []
        position = 0
        for request in requests:
            drafts = request.draft_token_ids
            history = request.output_token_ids
            bitmask = request.token_bitmask
            for index, request_id in enumerate([request.request_id, *request.fork_ids]):
                params = request.sampling_params
                params = params.clone_for_sample(index) if index else params
                groups.append(DraftGroup(len(rows), drafts, request.draft_probs))
                for i in range(len(drafts) + 1):
                    before = history if not i else history + drafts[:i]
                    rows.append(
                        SampleRow(
                            request_id=request_id,
                            sampling_params=params,
                            prompt_token_ids=request.prompt_token_ids,
                            output_token_ids=before,
                            token_bitmask=None if bitmask is None else bitmask[i : i + 1],
                        )
                    )
                    logits_rows.append(position + i)
            position += len(drafts) + 1
        if len(rows) != logits.shape[0]:
            logits = logits[torch.tensor(logits_rows, device=logits.device)]
        meta = build_sampling_metadata(rows, self.generators, self.eos_token_ids, logits.device)
        if any(group.drafts for group in groups):
            accepted = verify(self.sampler, logits, meta, groups)
        else:
            accepted = [[token] for token in self.sampler(logits, meta).token_ids]
        row_tokens = [0] * len(rows)
        for group, tokens in zip(groups, accepted):
            row_tokens[group.first : group.first + len(tokens)] = tokens
        logprobs = self.sampler.logprobs(logits, row_tokens, meta)
        for group, tokens in zip(groups, accepted):
            request_id = rows[group.first].request_id
            result.sampled[request_id] = tokens
            if logprobs[group.first] is not None:
                result.logprobs[request_id] = logprobs[group.first : group.first + len(tokens)]
