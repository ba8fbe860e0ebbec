"""The table of overridable ops: for each, the core's default and the inputs it is checked on.

A backend's override (``Backend.op_overrides()``) runs on inputs in the dtype under test, on its
device; the core's default op runs on the same rounded inputs in float32, on the host (the
truth), and in the dtype (the baseline: an override may be as far from the truth as the default
op itself is in that dtype, twice over, on top of the dtype's tolerance). Cases
cover the shapes that matter (odd sizes, one row and many, bias present and absent, strided
views as the model passes them) and magnitudes from tiny (where a norm's epsilon dominates) to
large (where float16 squares overflow). An op the sampler calls on logits it has widened
(``apply_token_bitmask``) gets float32 inputs whatever the dtype under test; an op that returns
nothing works in place, and its first argument is its output. The LoRA ops keep their float32
buffer in float32 whatever the dtype (``lora_shrink`` returns it, ``lora_expand`` takes it), and
their mapping's ``token_slots`` goes to the backend's device. An op added to the contract later
(KV export/import) joins by adding its row to ``OP_TABLE``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from platform_core.backend_api import (
    ALL_QUANT_FORMATS,
    OVERRIDABLE_OPS,
    LayerOps,
    LoRAMapping,
    LoRASegment,
    QuantFormat,
    random_blocks,
)
from platform_core_conformance.tolerances import Tolerance

EPS = 1e-5
Inputs = tuple[object, ...]


@dataclass(frozen=True, slots=True)
class OpCase:
    """One call of an op: an id for reports, a float32 input builder and the inputs' magnitude.

    ``build(gen)`` returns the arguments; every float tensor among them is rounded to the dtype
    under test before either side runs.
    """

    name: str
    build: Callable[[torch.Generator], Inputs]
    magnitude: float = 1.0


@dataclass(frozen=True, slots=True)
class OpRun:
    """Outputs of one case: the backend's override, and the core's default in float32 (the
    truth) and in the dtype under test (the baseline)."""

    actual: tuple[torch.Tensor, ...]
    expected: tuple[torch.Tensor, ...]
    baseline: tuple[torch.Tensor, ...]


@dataclass(frozen=True, slots=True)
class OpSpec:
    """An overridable op: its cases, whether its output is compared exactly (indices, masked
    logits), the least tolerance it gets in any dtype (``floor``: an op allowed to round its
    inputs), whether it always gets float32 inputs (``widened``: the sampler's ops), the
    positions of arguments it takes in float32 whatever the dtype (``float32_args``: the LoRA
    buffer) and whether it returns float32 whatever the dtype (``float32_output``)."""

    cases: tuple[OpCase, ...]
    exact: bool = False
    floor: Tolerance | None = None
    widened: bool = False
    float32_args: tuple[int, ...] = ()
    float32_output: bool = False


def _randn(gen: torch.Generator, *dims: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(dims, generator=gen)


def _rms_case(name: str, dims: tuple[int, ...], magnitude: float) -> OpCase:
    def build(gen: torch.Generator) -> Inputs:
        weight = 1.0 + 0.2 * _randn(gen, dims[-1])
        return (_randn(gen, *dims, scale=magnitude), weight, EPS)

    return OpCase(f"{name}-x{list(dims)}", build, magnitude)


def _linear_case(name: str, rows: int, inputs: int, outputs: int, bias: bool, mag: float) -> OpCase:
    def build(gen: torch.Generator) -> Inputs:
        x = _randn(gen, rows, inputs, scale=mag)
        weight = _randn(gen, outputs, inputs, scale=inputs**-0.5)
        return (x, weight, _randn(gen, outputs, scale=mag) if bias else None)

    bias_id = "bias" if bias else "nobias"
    return OpCase(f"{name}-{rows}x{inputs}->{outputs}-{bias_id}", build, mag)


def _quantized_case(name: str, rows: int, fmt: QuantFormat, blocks: int, bias: bool) -> OpCase:
    """Random blocks of every bit pattern, of RMS ``inputs ** -0.5``: outputs of order one.
    A format of single-weight blocks with a scale per row (FP8) gets rows of ``32 * blocks + 3``
    weights: an odd length, which a kernel tiling the row must mask."""
    inputs = blocks * fmt.block_size if fmt.block_size > 1 else 32 * blocks + 3
    outputs = 37

    def build(gen: torch.Generator) -> Inputs:
        qweight = random_blocks(outputs, inputs, fmt, inputs**-0.5, gen)
        return (_randn(gen, rows, inputs), qweight, fmt, _randn(gen, outputs) if bias else None)

    bias_id = "bias" if bias else "nobias"
    return OpCase(f"{name}-{fmt.name}-{rows}x{inputs}->{outputs}-{bias_id}", build)


def _rotary_case(name: str, tokens: int, heads: int, kv_heads: int, size: int) -> OpCase:
    """Query and key as the model passes them: strided views of one fused q/k/v tensor."""

    def build(gen: torch.Generator) -> Inputs:
        qkv = _randn(gen, tokens, heads + 2 * kv_heads, size)
        query, key, _ = qkv.split((heads, kv_heads, kv_heads), dim=1)
        positions = torch.randint(0, 4096, (tokens, 1), generator=gen).float()
        inv_freq = 10000.0 ** (-torch.arange(0, size, 2).float() / size)
        angles = positions * inv_freq
        return (query, key, angles.cos(), angles.sin())

    return OpCase(f"{name}-t{tokens}-h{heads}-kv{kv_heads}-d{size}", build)


def _silu_case(name: str, rows: int, size: int, magnitude: float) -> OpCase:
    def build(gen: torch.Generator) -> Inputs:
        return (_randn(gen, rows, 2 * size, scale=magnitude),)

    return OpCase(f"{name}-{rows}x2*{size}", build, magnitude)


def _argmax_case(name: str, rows: int, vocab: int) -> OpCase:
    """Distinct small integers per row (exact in every dtype): one right answer per row."""

    def build(gen: torch.Generator) -> Inputs:
        rows_of = [torch.randperm(vocab, generator=gen) for _ in range(rows)]
        return (torch.stack(rows_of).float() - vocab // 2,)

    return OpCase(f"{name}-{rows}x{vocab}", build)


def _bitmask_case(
    name: str, rows: int, vocab: int, words: int, masked: tuple[int, ...], solid: bool = False
) -> OpCase:
    """Random logits and random words (every bit pattern, the bits past ``vocab`` included) for
    the rows ``masked``; ``solid``: the first masked row bans every token, the second none."""

    def build(gen: torch.Generator) -> Inputs:
        shape = (len(masked), words)
        bitmask = torch.randint(-(2**31), 2**31, shape, generator=gen, dtype=torch.int64).int()
        if solid:
            bitmask[0], bitmask[1] = 0, -1
        return (_randn(gen, rows, vocab), bitmask, torch.tensor(masked, dtype=torch.int64))

    return OpCase(f"{name}-{len(masked)}of{rows}x{vocab}-w{words}", build)


def lora_mapping(slots: tuple[int, ...], max_slots: int) -> LoRAMapping:
    """The mapping of tokens running with ``slots`` (-1: the base model), its segments the
    maximal runs of one slot."""
    segments: list[LoRASegment] = []
    for token, slot in enumerate(slots):
        if slot < 0:
            continue
        last = segments[-1] if segments else None
        if last is not None and last.end == token and last.slot == slot:
            segments[-1] = LoRASegment(last.start, token + 1, slot)
        else:
            segments.append(LoRASegment(token, token + 1, slot))
    return LoRAMapping(torch.tensor(slots, dtype=torch.int32), tuple(segments), max_slots)


LORA_SLOTS = 4
# name -> each token's slot: one token, a decode batch (slots out of order, base-model tokens
# between), ~100 tokens of a few prefills, only base-model tokens (no segments), no tokens.
LORA_STEPS: dict[str, tuple[int, ...]] = {
    "one-token": (2,),
    "decode": (3, -1, 0, 0, 2, 1, -1, 3, 1),
    "prefill": (2,) * 37 + (-1,) * 11 + (0,) * 29 + (3,) * 23,
    "base-only": (-1,) * 6,
    "no-tokens": (),
}


def _lora_shrink_case(step: str, inputs: int, rank: int, parts: int) -> OpCase:
    """Adapter A of RMS ``inputs ** -0.5``: buffer entries of order one."""
    slots = LORA_STEPS[step]

    def build(gen: torch.Generator) -> Inputs:
        lora_a = _randn(gen, LORA_SLOTS, parts, rank, inputs, scale=inputs**-0.5)
        return (_randn(gen, len(slots), inputs), lora_a, lora_mapping(slots, LORA_SLOTS))

    return OpCase(f"{step}-t{len(slots)}-in{inputs}-s{parts}-r{rank}", build)


def _lora_expand_case(step: str, slice_sizes: tuple[int, ...], rank: int) -> OpCase:
    """A random buffer (rows of base-model tokens too, which must not count) and adapter B of
    RMS ``rank ** -0.5``: deltas of order one on outputs of order one."""
    slots = LORA_STEPS[step]
    outputs, parts = sum(slice_sizes), len(slice_sizes)

    def build(gen: torch.Generator) -> Inputs:
        out = _randn(gen, len(slots), outputs)
        buffer = _randn(gen, parts, len(slots), rank)
        lora_b = _randn(gen, LORA_SLOTS, outputs, rank, scale=rank**-0.5)
        return (out, buffer, lora_b, slice_sizes, lora_mapping(slots, LORA_SLOTS))

    sizes = "+".join(map(str, slice_sizes))
    return OpCase(f"{step}-t{len(slots)}-n{sizes}-r{rank}", build)


OP_TABLE: dict[str, OpSpec] = {
    "rms_norm": OpSpec(
        (
            _rms_case("odd", (5, 67), 1.0),
            _rms_case("heads", (3, 4, 32), 1.0),
            _rms_case("tiny", (4, 64), 1e-3),  # mean square 1e-6 < eps: epsilon dominates
            _rms_case("large", (4, 64), 300.0),  # squares overflow float16
        )
    ),
    "linear": OpSpec(
        (
            _linear_case("one-row", 1, 67, 35, True, 1.0),
            _linear_case("rows", 7, 64, 48, True, 1.0),
            _linear_case("odd", 7, 67, 33, False, 1.0),
            _linear_case("large", 5, 64, 40, True, 100.0),
        )
    ),
    "rotary": OpSpec(
        (
            _rotary_case("gqa", 5, 4, 2, 64),
            _rotary_case("odd", 7, 3, 1, 32),
        )
    ),
    "silu_and_mul": OpSpec(
        (
            _silu_case("odd", 5, 67, 1.0),
            _silu_case("one-row", 1, 128, 1.0),
            _silu_case("large", 4, 64, 30.0),
        )
    ),
    "argmax": OpSpec((_argmax_case("odd", 3, 67), _argmax_case("rows", 9, 256)), exact=True),
    # A kernel may round each 32 inputs to 8 bits with one scale, as llama.cpp does: about
    # 2^-9 relative per input, about 0.6% relative RMS over a row of products.
    "quantized_linear": OpSpec(
        tuple(
            case
            for fmt in ALL_QUANT_FORMATS.values()
            for case in (
                _quantized_case("one-row", 1, fmt, 3, True),
                _quantized_case("rows", 9, fmt, 2, False),
            )
        ),
        floor=Tolerance(atol=2e-2, rtol=2e-2, rms=1e-2),
    ),
    "apply_token_bitmask": OpSpec(
        (
            _bitmask_case("one-token", 2, 1, 1, (1,)),
            _bitmask_case("short", 4, 31, 1, (3, 0)),
            _bitmask_case("odd", 5, 33, 2, (4, 1, 2)),
            _bitmask_case("wide", 6, 67, 5, (5, 2, 0)),  # three words past the vocab
            _bitmask_case("rows", 9, 1000, 32, (8, 1, 6, 3)),
            _bitmask_case("solid", 4, 1000, 34, (2, 0), solid=True),
            _bitmask_case("none", 3, 67, 3, ()),
        ),
        exact=True,
        widened=True,
    ),
    "lora_shrink": OpSpec(
        (
            _lora_shrink_case("one-token", 67, 8, 3),
            _lora_shrink_case("decode", 64, 16, 2),
            _lora_shrink_case("decode", 33, 1, 1),
            _lora_shrink_case("prefill", 96, 8, 3),
            _lora_shrink_case("prefill", 64, 16, 1),
            _lora_shrink_case("base-only", 64, 8, 3),
            _lora_shrink_case("no-tokens", 64, 8, 2),
        ),
        float32_output=True,
    ),
    "lora_expand": OpSpec(
        (
            _lora_expand_case("one-token", (64, 16, 33), 8),
            _lora_expand_case("decode", (40, 24), 16),
            _lora_expand_case("decode", (37,), 1),
            _lora_expand_case("prefill", (64, 16, 33), 8),
            _lora_expand_case("prefill", (96, 48), 16),
            _lora_expand_case("base-only", (40, 24), 8),
            _lora_expand_case("no-tokens", (48, 16, 16), 8),
        ),
        float32_args=(1,),
    ),
}
assert set(OP_TABLE) == set(OVERRIDABLE_OPS), "every overridable op needs a row in OP_TABLE"

DEFAULTS = LayerOps()


def cast_inputs(
    inputs: Inputs,
    dtype: torch.dtype,
    device: torch.device | None = None,
    float32_args: tuple[int, ...] = (),
) -> Inputs:
    """``inputs`` with every float tensor in ``dtype`` (views kept: a strided view stays one),
    except those at ``float32_args``, in float32; a LoRA mapping's slots go to ``device``."""

    def cast(arg: object, target: torch.dtype) -> object:
        if isinstance(arg, LoRAMapping) and device is not None:
            return dataclasses.replace(arg, token_slots=arg.token_slots.to(device))
        if not isinstance(arg, torch.Tensor) or not arg.is_floating_point():
            return arg
        base = arg if arg._base is None else arg._base
        moved = base.to(dtype=target, device=device, copy=True)
        # A view is re-created on the copied base with its own strides.
        return moved.as_strided(arg.shape, arg.stride(), arg.storage_offset())

    return tuple(
        cast(arg, torch.float32 if index in float32_args else dtype)
        for index, arg in enumerate(inputs)
    )


def outputs_of(result: object) -> tuple[torch.Tensor, ...]:
    """An op's result as a tuple of tensors (rotary returns two)."""
    return tuple(result) if isinstance(result, tuple) else (result,)


def run_case(
    name: str,
    case: OpCase,
    override: Callable[..., object],
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> OpRun:
    """Run op ``name`` on ``case`` in ``dtype`` (float32 for a widened op): the override on
    ``device``, the default here."""
    spec = OP_TABLE[name]
    if spec.widened:
        dtype = torch.float32
    inputs = case.build(torch.Generator().manual_seed(seed))
    rounded = cast_inputs(cast_inputs(inputs, dtype), torch.float32)
    keep = spec.float32_args
    default = getattr(DEFAULTS, name)

    def call(op: Callable[..., object], args: Inputs) -> tuple[torch.Tensor, ...]:
        result = op(*args)
        return outputs_of(args[0] if result is None else result)

    # Each side gets its own copies (an op may work in place).
    return OpRun(
        actual=call(override, cast_inputs(rounded, dtype, device, keep)),
        expected=call(default, cast_inputs(rounded, torch.float32)),
        baseline=call(default, cast_inputs(rounded, dtype, float32_args=keep)),
    )
