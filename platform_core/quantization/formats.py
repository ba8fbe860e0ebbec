"""Weight-only quantized formats kept as stored, and the reference quantized linear.

A quantized weight of ``out_features x in_features`` is a ``uint8`` tensor
``[out_features, row_bytes]``: each row is the row's blocks, back to back, in the format's own
byte layout, exactly as a GGUF file stores them (GGUF tensors are row-major with blocks along
the input dimension, so a row of blocks is a row of the weight). Rows are therefore independent:
row shards, fused projections (rows stacked) and row permutations work on the bytes unchanged,
and a column shard is a slice of whole blocks.

The layouts (``d``, ``m``, ``dmin`` are float16; ``q`` are the stored integers):

- ``Q8_0``: 32 weights, ``d`` then 32 int8 ``q``; ``w = d * q``.
- ``Q4_0``: 32 weights, ``d`` then 16 bytes; byte ``j`` holds weight ``j`` in its low nibble and
  weight ``j + 16`` in its high one; ``w = d * (q - 8)``.
- ``Q4_1``: as ``Q4_0`` with ``m`` after ``d``; ``w = d * q + m``.
- ``Q4_K``: 256 weights in 8 groups of 32: ``d``, ``dmin``, 12 bytes packing 8 six-bit scales
  and 8 six-bit mins, then 128 bytes of nibbles (each 32 bytes hold two groups: low nibbles the
  first, high the second); ``w = d * scale * q - dmin * min``.
- ``Q6_K``: 256 weights in two halves of 128: 128 bytes of low nibbles, 64 bytes of high 2-bit
  pairs, 16 int8 scales (one per 16 weights), then ``d``; ``w = d * scale * (q - 32)``.
- ``FP8_E4M3``: per-output-channel FP8. A row is its float32 scale ``s`` (4 bytes), then one
  float8 e4m3 (``e4m3fn``: no infinities, ``0x7F``/``0xFF`` are NaN) byte ``q`` per weight;
  ``w = s * q``. A per-tensor scale is the same ``s`` in every row.

FP8 fits the same contract (``uint8 [rows, row_bytes]``, ``quantized_linear(x, qweight, fmt,
bias)``) as a format whose blocks are single weights and whose rows start with their scale
(``scale_bytes``). Keeping the scale inside the row, rather than as a second tensor beside the
weight, leaves the op's signature, the layers and the loader's row shards and fused parts (rows
stacked) as they are for the GGML formats. A column shard (a row-parallel linear under tensor
parallelism) is the row's scale then its own columns: the scale is the whole row's, so every
rank holds the same values as one rank would (the loader quantizes with the full row's scale).

:func:`quantized_linear` (dequantize, then ``F.linear``) is the reference every backend's
``quantized_linear`` op is checked against. :func:`quantize` makes Q8_0, Q4_1 and FP8_E4M3
weights from 16/32-bit ones (``quantization="int8"`` / ``"int4"`` / ``"fp8"`` at load time).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class QuantFormat:
    """A block format: ``block_size`` weights stored in ``block_bytes`` bytes, with float16
    scale fields at byte offsets ``half_fields`` of each block; each row starts with a float32
    scale of ``scale_bytes`` (4) when the format has one per row (FP8), else 0."""

    name: str
    block_size: int
    block_bytes: int
    half_fields: tuple[int, ...]
    scale_bytes: int = 0

    def row_bytes(self, in_features: int) -> int:
        """Bytes of one weight row of ``in_features`` (a multiple of ``block_size``)."""
        if in_features % self.block_size:
            raise ValueError(
                f"{self.name} stores rows in blocks of {self.block_size} weights; "
                f"{in_features} is not a multiple"
            )
        return self.scale_bytes + in_features // self.block_size * self.block_bytes

    def in_features(self, row_bytes: int) -> int:
        """The weights in a row of ``row_bytes`` bytes."""
        return (row_bytes - self.scale_bytes) // self.block_bytes * self.block_size


Q8_0 = QuantFormat("Q8_0", 32, 34, (0,))
Q4_0 = QuantFormat("Q4_0", 32, 18, (0,))
Q4_1 = QuantFormat("Q4_1", 32, 20, (0, 2))
Q4_K = QuantFormat("Q4_K", 256, 144, (0, 2))
Q6_K = QuantFormat("Q6_K", 256, 210, (208,))
QUANT_FORMATS = {f.name: f for f in (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K)}  # the GGML block formats
FP8_E4M3 = QuantFormat("FP8_E4M3", 1, 1, (), scale_bytes=4)
FP8_MAX = 448.0  # the largest finite float8 e4m3fn
# every format the quantized_linear op takes (the conformance suite checks each)
ALL_QUANT_FORMATS = {**QUANT_FORMATS, FP8_E4M3.name: FP8_E4M3}

# ``(x, qweight, fmt, bias) -> x @ dequantize(qweight, fmt).T (+ bias)`` in ``x``'s dtype.
QuantizedLinearFn = Callable[
    [torch.Tensor, torch.Tensor, QuantFormat, "torch.Tensor | None"], torch.Tensor
]


def random_blocks(
    rows: int, in_features: int, fmt: QuantFormat, weight_rms: float, gen: torch.Generator
) -> torch.Tensor:
    """Random ``fmt`` weights of about ``weight_rms``: random bytes (every bit of every integer
    field), with one scale in every float16 field; FP8 rows get scales that differ by up to 4x
    and every code but NaN. Test inputs for ``quantized_linear`` ops."""
    qweight = torch.randint(0, 256, (rows, fmt.row_bytes(in_features)), generator=gen)
    qweight = qweight.to(torch.uint8)
    row_scales = None
    if fmt.scale_bytes:
        codes = qweight[:, fmt.scale_bytes :]
        codes[(codes & 0x7F) == 0x7F] ^= 1  # NaN -> +-448
        row_scales = 0.5 + 1.5 * torch.rand(rows, 1, generator=gen)
    blocks = qweight[:, fmt.scale_bytes :].unflatten(1, (-1, fmt.block_bytes))

    def set_scales(scale: float) -> None:
        if row_scales is not None:
            qweight[:, : fmt.scale_bytes] = _float32_bytes(row_scales * scale)
        half = torch.tensor([scale], dtype=torch.float16).view(torch.uint8)
        for offset in fmt.half_fields:
            blocks[..., offset : offset + 2] = half

    set_scales(1.0)  # every weight is linear in the common scale: measure, then rescale
    measured = dequantize(qweight, fmt).pow(2).mean().sqrt().item()
    set_scales(weight_rms / measured)
    return qweight


def _float_from_bits(
    bits: torch.Tensor, exponent_bits: int, mantissa_bits: int, ieee_specials: bool = True
) -> torch.Tensor:
    """IEEE-style floating-point bit patterns (integers, sign in the top bit) -> float32.

    Decoded with arithmetic, exactly: reinterpreting bytes as another dtype (a dtype view)
    cannot be traced, and the CPU backend traces one-token steps, embedding lookups included.
    With ``ieee_specials`` an all-ones exponent is infinity or NaN; without (float8 e4m3fn) it
    holds finite values and only an all-ones mantissa there is NaN.
    """
    bias = (1 << (exponent_bits - 1)) - 1
    top = (1 << exponent_bits) - 1
    exponent = (bits >> mantissa_bits) & top
    mantissa = bits & ((1 << mantissa_bits) - 1)
    fraction = mantissa.float() / (1 << mantissa_bits)
    normal = torch.ldexp(1.0 + fraction, exponent - bias)
    subnormal = torch.ldexp(fraction, torch.full_like(bits, 1 - bias))
    value = torch.where(exponent == 0, subnormal, normal)
    if ieee_specials:
        special = torch.where(mantissa == 0, torch.inf, torch.nan)
        value = torch.where(exponent == top, special, value)
    else:
        nan = (exponent == top) & (mantissa == (1 << mantissa_bits) - 1)
        value = torch.where(nan, torch.nan, value)
    negative = ((bits >> (exponent_bits + mantissa_bits)) & 1) == 1
    return torch.where(negative, -value, value)


def _half(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at byte ``offset`` of every block, as float32 ``[..., 1]``."""
    bits = blocks[..., offset].to(torch.int32) | (blocks[..., offset + 1].to(torch.int32) << 8)
    return _float_from_bits(bits, 5, 10).unsqueeze(-1)


def _float32_at(rows: torch.Tensor, offset: int) -> torch.Tensor:
    """The little-endian float32 at byte ``offset`` of every row, as ``[..., 1]``."""
    bits = sum(rows[..., offset + i].to(torch.int64) << (8 * i) for i in range(4))
    return _float_from_bits(bits, 8, 23).unsqueeze(-1)


def _e4m3(codes: torch.Tensor) -> torch.Tensor:
    """float8 e4m3fn bytes -> float32."""
    return _float_from_bits(codes.to(torch.int32), 4, 3, ieee_specials=False)


def _signed(packed: torch.Tensor) -> torch.Tensor:
    """Bytes read as int8 (two's complement), as float32."""
    return ((packed.to(torch.int32) ^ 0x80) - 0x80).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Bytes ``[..., n]`` -> ``[..., 2n]``: the low nibbles, then the high ones."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=-1)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return _half(blocks, 0) * _signed(blocks[..., 2:])


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return _half(blocks, 0) * (_nibbles(blocks[..., 2:]).float() - 8.0)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _half(blocks, 0) * _nibbles(blocks[..., 4:]).float() + _half(blocks, 2)


def _k4_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins, ``[..., 8]`` each."""
    low, mid, high = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat((low & 63, (high & 0x0F) | ((low >> 6) << 4)), dim=-1)
    mins = torch.cat((mid & 63, (high >> 4) | ((mid >> 6) << 4)), dim=-1)
    return scales.float(), mins.float()


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    scales, mins = _k4_scales_mins(blocks[..., 4:16])
    groups = blocks[..., 16:].unflatten(-1, (4, 32))  # 4 x 32 bytes, two groups each
    q = torch.stack((groups & 0x0F, groups >> 4), dim=-2).flatten(-3, -2).float()  # [..., 8, 32]
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    values = (d * scales).unsqueeze(-1) * q - (dmin * mins).unsqueeze(-1)
    return values.flatten(-2)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    low = blocks[..., :128].unflatten(-1, (2, 2, 32)).to(torch.int32)  # half, ql 0/32, l
    high = blocks[..., 128:192].unflatten(-1, (2, 1, 32)).to(torch.int32)  # half, -, l
    scales = _signed(blocks[..., 192:208])
    d = _half(blocks, 208)
    # Within a half, the four 32-weight quarters take the low nibbles of ql[0:32] and
    # ql[32:64], then their high nibbles, with 2-bit pairs 0, 1, 2, 3 of qh.
    nibble = torch.cat((low & 0x0F, low >> 4), dim=-2)  # half, quarter, l
    shifts = torch.arange(4, dtype=torch.int32, device=blocks.device).view(4, 1) * 2
    pairs = (high >> shifts) & 3  # half, quarter, l
    q = (nibble | (pairs << 4)).float() - 32.0
    values = q.flatten(-3).unflatten(-1, (16, 16)) * scales.unsqueeze(-1)
    return d * values.flatten(-2)


_DEQUANTIZERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q6_K": _q6_k}


def dequantize(
    qweight: torch.Tensor, fmt: QuantFormat, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``uint8 [rows, row_bytes]`` blocks of ``fmt`` -> ``[rows, in_features]`` in ``dtype``."""
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError(
            f"quantized weights are uint8 [rows, bytes], got {qweight.dtype} {tuple(qweight.shape)}"
        )
    if fmt.scale_bytes:  # FP8: the row's scale times each weight's code
        codes = qweight[:, fmt.scale_bytes :]
        return (_float32_at(qweight, 0) * _e4m3(codes)).to(dtype)
    try:  # no test of the row's length here: it would stop the CPU backend's trace
        blocks = qweight.unflatten(1, (-1, fmt.block_bytes))
    except RuntimeError as exc:
        raise ValueError(
            f"a row of {qweight.shape[1]} bytes is not whole {fmt.name} blocks"
        ) from exc
    return _DEQUANTIZERS[fmt.name](blocks).flatten(1).to(dtype)


def _half_bytes(values: torch.Tensor) -> torch.Tensor:
    """float32 ``[..., 1]`` -> its float16's two bytes ``[..., 2]``."""
    return values.to(torch.float16).view(torch.uint8)


def _float32_bytes(values: torch.Tensor) -> torch.Tensor:
    """float ``[..., 1]`` -> its float32's four bytes ``[..., 4]``."""
    return values.to(torch.float32).contiguous().view(torch.uint8)


def fp8_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``float8_e4m3fn [rows, in_features]`` codes and float32 scales (one per row ``[rows,
    1]``, or one for the tensor) -> FP8_E4M3 rows ``uint8 [rows, 4 + in_features]``."""
    scales = scales.to(torch.float32).reshape(-1, 1).expand(codes.shape[0], 1)
    return torch.cat((_float32_bytes(scales), codes.contiguous().view(torch.uint8)), dim=-1)


def _quantize_fp8(weights: torch.Tensor, columns: slice) -> torch.Tensor:
    """Rows scaled by ``max |w| / 448`` (of the whole row), then rounded to the nearest e4m3;
    only ``columns`` are kept (a column shard's rows hold the whole row's scale)."""
    if not torch.isfinite(weights).all():
        raise ValueError("FP8 quantization needs finite weights; this tensor has inf or NaN")
    scale = weights.abs().amax(-1, keepdim=True) / FP8_MAX
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = (weights[:, columns] * inverse).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return fp8_rows(codes, scale)


def _quantize_q8_0(groups: torch.Tensor) -> torch.Tensor:
    scale = (groups.abs().amax(-1, keepdim=True) / 127).to(torch.float16).float()
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = _round_half_away(groups * inverse).clamp(-127, 127).to(torch.int16)
    return torch.cat((_half_bytes(scale), (q & 0xFF).to(torch.uint8)), dim=-1)


def _quantize_q4_1(groups: torch.Tensor) -> torch.Tensor:
    low = groups.amin(-1, keepdim=True).to(torch.float16).float()
    scale = ((groups.amax(-1, keepdim=True) - low) / 15).to(torch.float16).float()
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = _round_half_away((groups - low) * inverse).clamp(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return torch.cat((_half_bytes(scale), _half_bytes(low), packed), dim=-1)


def _round_half_away(values: torch.Tensor) -> torch.Tensor:
    return torch.sign(values) * torch.floor(values.abs() + 0.5)


_QUANTIZERS = {"Q8_0": _quantize_q8_0, "Q4_1": _quantize_q4_1}
QUANTIZABLE = (*_QUANTIZERS, FP8_E4M3.name)


def quantize(weights: torch.Tensor, fmt: QuantFormat, columns: slice = slice(None)) -> torch.Tensor:
    """``[rows, in_features]`` float weights -> ``uint8 [rows, row_bytes]`` of ``fmt`` (one of
    :data:`QUANTIZABLE`), of the weights' ``columns`` only (whole blocks). Per 32 weights, Q8_0
    keeps ``max |w| / 127`` and rounds to the nearest step; Q4_1 keeps the minimum and ``(max -
    min) / 15`` (each float16, and the rounding uses the float16 values, so the error is at most
    half a step). FP8_E4M3 keeps ``max |w| / 448`` of each whole row (float32) and rounds each
    weight to the nearest e4m3 value: a relative error of at most 2^-4."""
    if fmt.scale_bytes:
        return _quantize_fp8(weights.float(), columns)
    if fmt.name not in _QUANTIZERS:
        raise ValueError(f"cannot quantize to {fmt.name}; can: {QUANTIZABLE}")
    weights = weights[:, columns]
    fmt.row_bytes(weights.shape[1])  # a ValueError unless whole blocks
    groups = weights.float().unflatten(1, (-1, fmt.block_size))
    return _QUANTIZERS[fmt.name](groups).flatten(1)


def quantized_linear(
    x: torch.Tensor, qweight: torch.Tensor, fmt: QuantFormat, bias: torch.Tensor | None
) -> torch.Tensor:
    """The reference :data:`QuantizedLinearFn`: dequantize to ``x``'s dtype, then ``F.linear``."""
    return F.linear(x, dequantize(qweight, fmt, x.dtype), bias)


def has_kernel(op: QuantizedLinearFn | None, fmt: QuantFormat) -> bool:
    """Whether a backend's ``quantized_linear`` ``op`` (None: it has none) computes on ``fmt``
    with a kernel of its own rather than through :func:`quantized_linear`. An op may name the
    formats it has kernels for in a ``kernel_formats`` attribute; one that names none is taken
    to have kernels for the GGML block formats (:data:`QUANT_FORMATS`, the op's formats before
    FP8 joined them), so FP8 on it is taken to run the reference op."""
    if op is None or op is quantized_linear:
        return False
    return fmt.name in getattr(op, "kernel_formats", QUANT_FORMATS)
