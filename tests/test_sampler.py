"""Sampler and logit processors on fixed logits: every parameter, batched."""

from __future__ import annotations

import math

import pytest
import torch

from platform_core.errors import InvalidRequestError
from platform_core.sample.metadata import GeneratorStore, SampleRow, build_sampling_metadata
from platform_core.sample.processors import apply_allowed_bias_and_blocks, apply_penalties
from platform_core.sample.sampler import Sampler, apply_top_k_top_p, fill_exponential
from platform_core.sampling_params import SamplingParams

EOS = 7


def meta_for(params, outputs=None, prompts=None, ids=None):
    rows = [
        SampleRow(
            request_id=ids[i] if ids else f"r{i}",
            sampling_params=p,
            prompt_token_ids=(prompts or [[]] * len(params))[i],
            output_token_ids=(outputs or [[]] * len(params))[i],
        )
        for i, p in enumerate(params)
    ]
    return build_sampling_metadata(rows, GeneratorStore(), frozenset({EOS}), torch.device("cpu"))


def sample(logits, params, seed=0, **kwargs):
    sampler = Sampler(torch.Generator().manual_seed(seed))
    return sampler(logits, meta_for(params, **kwargs))


LOGITS = torch.tensor([[0.1, 2.0, -1.0, 0.5, 1.5, -0.3, 0.0, 1.9]])


def test_greedy_and_equivalents():
    greedy = int(LOGITS.argmax())
    for params in (
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=1),
        SamplingParams(top_p=1e-6),
        SamplingParams(min_p=0.999),
    ):
        for seed in range(5):
            assert sample(LOGITS, [params], seed).token_ids == [greedy], params


def test_the_backends_argmax_picks_greedy_and_sampled_tokens():
    calls = []

    def reversed_argmax(x):  # the last maximal index: visibly not torch's answer on ties
        calls.append(tuple(x.shape))
        return x.shape[1] - 1 - x.flip(-1).argmax(dim=-1)

    tied = torch.tensor([[3.0, 1.0, 3.0, 0.0]])
    sampler = Sampler(torch.Generator().manual_seed(0), argmax=reversed_argmax)
    assert sampler(tied, meta_for([SamplingParams(temperature=0.0)])).token_ids == [2]
    assert calls == [(1, 4)]
    sampler(tied, meta_for([SamplingParams(temperature=0.8, seed=1)]))
    assert len(calls) == 3  # greedy candidates, then the exponential race


def test_narrow_logits_greedy_as_they_are_everything_else_in_float32():
    dtypes = []

    def recording_argmax(x):
        dtypes.append(x.dtype)
        return x.argmax(dim=-1)

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(5)).bfloat16()
    sampler = Sampler(torch.Generator().manual_seed(0), argmax=recording_argmax)
    greedy = SamplingParams(temperature=0.0)
    out = sampler(logits, meta_for([greedy] * 4))
    assert dtypes == [torch.bfloat16]  # no widened copy for a plain greedy batch
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()
    dtypes.clear()
    biased = SamplingParams(temperature=0.0, logit_bias={7: 100.0}, logprobs=2)
    out = sampler(logits, meta_for([biased, greedy, greedy, greedy]))
    assert dtypes == [torch.float32] and out.token_ids[0] == 7
    # Logprobs are of the raw logits, computed in float32 either way.
    wide = sampler(logits.float(), meta_for([biased, greedy, greedy, greedy]))
    assert out.logprobs[0] == wide.logprobs[0]
    probs = sampler.probabilities(logits, meta_for([SamplingParams(temperature=0.7)] * 4))
    assert probs.dtype == torch.float32
    assert torch.allclose(probs.sum(dim=-1), torch.ones(4))


def test_top_k_and_top_p_masks():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    masked = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isinf(masked[0, 2:]).all() and torch.isfinite(masked[0, :2]).all()
    masked = apply_top_k_top_p(logits, torch.tensor([-1]), torch.tensor([0.65]))
    # 0.4 + 0.3 = 0.7 >= 0.65: the nucleus is the first two tokens.
    assert torch.isfinite(masked[0, :2]).all() and torch.isinf(masked[0, 2:]).all()
    masked = apply_top_k_top_p(logits, torch.tensor([-1]), torch.tensor([0.7001]))
    assert torch.isfinite(masked[0, :3]).all() and torch.isinf(masked[0, 3])


def test_repetition_frequency_presence_change_exactly_the_expected_logits():
    logits = torch.tensor([[2.0, -2.0, 1.0, 3.0, 0.5]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits, meta_for([params], outputs=[[3, 3, 1]], prompts=[[0]]))
    expected = torch.tensor(
        [
            [
                2.0 / 2,  # prompt token: repetition only
                -2.0 * 2 - 0.5 * 1 - 0.25,  # output once
                1.0,  # unseen
                3.0 / 2 - 0.5 * 2 - 0.25,  # output twice
                0.5,
            ]
        ]
    )
    torch.testing.assert_close(out, expected)


def test_unpenalized_rows_are_untouched_in_a_mixed_batch():
    logits = torch.randn(3, 10)
    params = [SamplingParams(), SamplingParams(presence_penalty=1.0), SamplingParams()]
    out = apply_penalties(logits, meta_for(params, outputs=[[1], [1], [1]]))
    torch.testing.assert_close(out[[0, 2]], logits[[0, 2]])
    assert out[1, 1] == logits[1, 1] - 1.0


def test_logit_bias_allowed_ids_and_min_tokens():
    logits = torch.zeros(3, 10)
    params = [
        SamplingParams(logit_bias={3: 5.0, 4: -100.0}),
        SamplingParams(allowed_token_ids=[2, 5]),
        SamplingParams(min_tokens=2, stop_token_ids=[9]),
    ]
    out = apply_allowed_bias_and_blocks(logits, meta_for(params, outputs=[[], [], [1]]))
    assert out[0, 3] == 5.0 and out[0, 4] == -100.0 and out[0, 0] == 0.0
    assert torch.isfinite(out[1, [2, 5]]).all()
    assert torch.isinf(out[1, [0, 1, 3, 4, 6, 7, 8, 9]]).all()
    assert torch.isinf(out[2, [EOS, 9]]).all() and out[2, 0] == 0.0
    # Once min_tokens outputs exist, EOS is allowed again.
    out = apply_allowed_bias_and_blocks(logits, meta_for(params[2:], outputs=[[1, 2]]))
    assert torch.isfinite(out).all()


def test_allowed_ids_restrict_sampling():
    logits = torch.randn(1, 50)
    params = SamplingParams(temperature=1.5, allowed_token_ids=[4, 9, 31])
    for seed in range(20):
        assert sample(logits, [params], seed).token_ids[0] in {4, 9, 31}


def test_temperature_sampling_follows_softmax_chi_square():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 0.25, 0.75, -0.25])
    temperature = 0.7
    draws = 8000
    sampler = Sampler(torch.Generator().manual_seed(1234))
    batch = logits.repeat(draws, 1)
    params = [SamplingParams(temperature=temperature)] * draws
    tokens = torch.tensor(sampler(batch, meta_for(params)).token_ids)
    observed = torch.bincount(tokens, minlength=8).double()
    expected = torch.softmax(logits.double() / temperature, dim=0) * draws
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 24.32, f"chi-square {chi2:.1f} exceeds the p=0.001 bound for 7 degrees of freedom"


def test_exponential_noise_is_exp_1_above_zero_and_follows_its_generator():
    draws = fill_exponential(torch.empty(200_000), torch.Generator().manual_seed(7))
    assert float(draws.min()) > 0.0
    assert abs(float(draws.mean()) - 1.0) < 0.01 and abs(float(draws.var()) - 1.0) < 0.03
    for x in (0.1, 1.0, 3.0):  # the tail P(X > x) = exp(-x)
        assert abs(float((draws > x).double().mean()) - math.exp(-x)) < 0.004
    again = fill_exponential(torch.empty(200_000), torch.Generator().manual_seed(7))
    assert torch.equal(draws, again)
    # A uniform draw of 0 would be an exponential 0: floored to the smallest normal float.
    zero = torch.zeros(3)
    zero.uniform_ = lambda generator=None: zero  # type: ignore[method-assign]
    assert fill_exponential(zero, None).tolist() == [torch.finfo(torch.float32).tiny] * 3


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(4, 64)
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = [
        Sampler(torch.Generator().manual_seed(s))(logits[:1], meta_for([seeded])).token_ids[0]
        for s in (0, 1)
    ]
    assert alone[0] == alone[1]  # the engine-wide seed does not matter
    others = [SamplingParams(temperature=1.0)] * 3
    mixed = Sampler(torch.Generator().manual_seed(9))(
        logits[[1, 2, 0, 3]], meta_for([*others[:2], seeded, others[2]])
    )
    assert mixed.token_ids[2] == alone[0]


def test_logprobs_are_raw_log_softmax_with_rank():
    params = SamplingParams(temperature=0.0, logprobs=3, presence_penalty=2.0)
    out = sample(LOGITS, [params], outputs=[[1]])
    entry = out.logprobs[0]
    raw = torch.log_softmax(LOGITS[0], dim=0)
    # Presence penalty pushes token 1 down, so greedy picks 7, but logprobs stay raw.
    assert out.token_ids == [7] and entry.token_id == 7
    assert math.isclose(entry.logprob, float(raw[7]), abs_tol=1e-6)
    assert entry.rank == 2
    assert [t for t, _ in entry.top] == raw.topk(3).indices.tolist()


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("temperature", -0.1, "temperature must be a finite number >= 0"),
        ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
        ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
        ("n", 0, "n must be an integer >= 1"),
        ("top_k", -2, "top_k"),
        ("min_p", 2.0, "min_p"),
        ("logprobs", 50, "logprobs"),
        ("repetition_penalty", 0.0, "repetition_penalty"),
        ("max_tokens", 0, "max_tokens"),
        ("stop", [""], "stop"),
    ],
)
def test_invalid_values_name_field_and_range(field, value, message):
    with pytest.raises(InvalidRequestError, match=message) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


def test_unknown_token_ids_are_refused():
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias={1000: 1.0}).validate_token_ids(100)
    with pytest.raises(InvalidRequestError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[-1]).validate_token_ids(100)
