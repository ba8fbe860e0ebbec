"""Paged attention of the CPU backend: a compiled C++/OpenMP kernel with a pure-torch fallback.

Cache layout of one layer: ``[2, num_blocks, num_kv_heads, block_size * head_size]`` (0 keys,
1 values): one contiguous tile per block and KV head, keys stored as ``[head_size / 2,
block_size, 2]`` and values as ``[block_size / 2, head_size, 2]`` (element pairs the kernel
multiplies without horizontal sums; both sizes must be even). The path is chosen by
``PLATFORM_CORE_CPU_KERNEL``: ``compiled`` (the C++ kernel; an error if it cannot be built),
``torch`` (the fallback), or ``auto`` (default: compiled, else the fallback with a warning).
The compiled kernels are the build of this CPU's ISA level (:mod:`platform_core_cpu.isa`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.nn.functional as F

from platform_core.backend_api import AttentionMetadata, AttentionOps, BackendError, ConfigError
from platform_core_cpu.isa import host_isa
from platform_core_cpu.kernels import load_kernels

logger = logging.getLogger("platform_core_cpu")

KERNEL_ENV = "PLATFORM_CORE_CPU_KERNEL"
KERNEL_MODES = ("auto", "compiled", "torch")


class CpuAttentionOps(AttentionOps):
    """CPU paged-attention ops; ``mode`` (default: ``$PLATFORM_CORE_CPU_KERNEL`` or ``auto``)
    picks the compiled kernel or the torch fallback, resolved on first use; ``level`` the ISA
    level of the kernel build (default: this CPU's, see :func:`~platform_core_cpu.isa.host_isa`).
    """

    def __init__(self, mode: str | None = None, level: str | None = None) -> None:
        mode = mode or os.environ.get(KERNEL_ENV, "auto")
        if mode not in KERNEL_MODES:
            raise ConfigError(f"{KERNEL_ENV}={mode!r} is not valid; valid values: {KERNEL_MODES}")
        self.mode = mode
        self.level = level or host_isa().level
        self._ops: Any = None
        self._resolved = False

    @property
    def kernel(self) -> str:
        """The path in use: ``"compiled"`` or ``"torch"`` (builds the kernel if needed)."""
        return "compiled" if self.compiled_ops() is not None else "torch"

    def compiled_ops(self) -> Any:
        """The kernel build's ``torch.ops`` namespace (attention, fused layer ops, bf16
        linear), or ``None`` on the torch path."""
        if not self._resolved:
            self._ops = self._resolve()
            self._resolved = True
        return self._ops

    def _resolve(self) -> Any:
        if self.mode == "torch":
            logger.info("CPU attention: torch path (%s=torch)", KERNEL_ENV)
            return None
        build = load_kernels(self.level)
        if build.ops is not None:
            logger.info(
                "CPU attention: compiled kernel, %s build (loaded in %.1f s)",
                self.level,
                build.seconds,
            )
            return build.ops
        if self.mode == "compiled":
            raise BackendError(f"CPU attention kernel could not be built: {build.reason}")
        logger.warning(
            "CPU attention: compiled kernel unavailable, using the slower torch fallback (%s)",
            build.reason,
        )
        return None

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """``[2, num_blocks, num_kv_heads, block_size * head_size]``; both sizes even."""
        if block_size % 2 or head_size % 2:
            raise ConfigError(
                f"the CPU cache pairs tokens and dimensions: block_size ({block_size}) and "
                f"head_size ({head_size}) must be even"
            )
        return (2, num_blocks, num_kv_heads, block_size * head_size)

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]``; ``-1`` slots skip."""
        if key.dtype != kv_cache.dtype or value.dtype != kv_cache.dtype:
            key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
        ops = self.compiled_ops()
        if ops is not None:
            # The metadata's dtypes are the builder's contract; the kernels check them.
            ops.write_kv(_rows_contiguous(key), _rows_contiguous(value), kv_cache, slot_mapping)
            return
        valid = slot_mapping >= 0
        slots = slot_mapping[valid].long()
        head_size = key.shape[2]
        block_size = kv_cache.shape[3] // head_size
        blocks, offsets = slots // block_size, slots % block_size
        keys, values = key_tokens(kv_cache[0], head_size), value_tokens(kv_cache[1], head_size)
        # Advanced indices split by a slice: the indexed result is [tokens, kv_heads, ...].
        keys[blocks, :, offsets] = key[valid].unflatten(-1, (head_size // 2, 2))
        values[blocks, :, offsets // 2, offsets % 2] = value[valid]

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal GQA attention of ``query`` ``[num_tokens, num_heads, head_size]``."""
        ops = self.compiled_ops()
        q = query if query.dtype == kv_cache.dtype else query.to(kv_cache.dtype)
        if ops is None:
            out = torch_paged_attention(q, kv_cache, metadata, scale)
        else:
            out = torch.empty_like(q)
            ops.paged_attention(
                _rows_contiguous(q),
                kv_cache,
                metadata.query_start_loc,
                metadata.seq_lens,
                metadata.block_tables,
                scale,
                out,
            )
        return out if out.dtype == query.dtype else out.to(query.dtype)

    def export_blocks(
        self, kv_cache: torch.Tensor, block_ids: torch.Tensor, *, block_size: int, head_size: int
    ) -> torch.Tensor:
        """Blocks ``block_ids`` as canonical ``[2, n, block_size, kv_heads, head_size]``: one
        gather per half that reorders the tiles as it copies."""
        self.check_block_ids(block_ids, kv_cache.shape[1])
        heads = kv_cache.shape[2]
        _check_tiles(kv_cache, block_size, heads, head_size)
        out = kv_cache.new_empty((2, block_ids.numel(), block_size, heads, head_size))
        keys, values = _key_words(kv_cache[0], head_size), _value_pairs(kv_cache[1], head_size)
        torch.index_select(keys, 0, block_ids, out=_canonical_key_words(out[0]))
        torch.index_select(values, 0, block_ids, out=_canonical_value_pairs(out[1]))
        return out

    def import_blocks(
        self, kv_cache: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor
    ) -> None:
        """Write canonical ``blocks`` at ``block_ids``: every token through :meth:`write_kv`
        at its slot (the compiled kernel's scatter runs close to copy speed)."""
        self.check_block_ids(block_ids, kv_cache.shape[1], distinct=True)
        block_size, heads, head_size = self.check_canonical_blocks(blocks, block_ids.numel())
        _check_tiles(kv_cache, block_size, heads, head_size)
        offsets = torch.arange(block_size, device=kv_cache.device)
        slots = (block_ids[:, None] * block_size + offsets).flatten()
        tokens = blocks.to(kv_cache.device).flatten(1, 2)  # [2, n * block_size, heads, head_size]
        self.write_kv(tokens[0], tokens[1], kv_cache, slots)


def _check_tiles(
    kv_cache: torch.Tensor, block_size: int, num_kv_heads: int, head_size: int
) -> None:
    """``ValueError`` unless canonical blocks of this geometry fit the cache's tiles."""
    _, _, heads, tile = kv_cache.shape
    if heads != num_kv_heads or block_size * head_size != tile or block_size % 2 or head_size % 2:
        raise ValueError(
            f"blocks of block_size {block_size}, {num_kv_heads} kv heads and head_size "
            f"{head_size} do not fit a CPU cache of {heads} kv heads and tiles of {tile} "
            "elements (block_size * head_size, both even)"
        )


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dimension is contiguous (the kernels take other strides)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def key_tokens(keys: torch.Tensor, head_size: int) -> torch.Tensor:
    """The key half ``[blocks, kv_heads, tile]`` of a cache as a view indexed by token:
    ``[blocks, kv_heads, block_size, head_size / 2, 2]``."""
    blocks, heads, tile = keys.shape
    return keys.view(blocks, heads, head_size // 2, tile // head_size, 2).transpose(2, 3)


def value_tokens(values: torch.Tensor, head_size: int) -> torch.Tensor:
    """The value half ``[blocks, kv_heads, tile]`` of a cache as a view indexed by token pair:
    ``[blocks, kv_heads, block_size / 2, 2, head_size]``."""
    blocks, heads, tile = values.shape
    return values.view(blocks, heads, tile // head_size // 2, head_size, 2).transpose(3, 4)


def _word(dtype: torch.dtype) -> torch.dtype:
    """The integer type as wide as two elements of ``dtype``: a pair moves as one word."""
    return {1: torch.int16, 2: torch.int32, 4: torch.int64}[dtype.itemsize]


def _key_words(keys: torch.Tensor, head_size: int) -> torch.Tensor:
    """The key half ``[blocks, kv_heads, tile]`` of a cache as a view of words (dimension
    pairs) in canonical order: ``[blocks, block_size, kv_heads, head_size / 2]``."""
    blocks, heads, tile = keys.shape
    words = keys.view(_word(keys.dtype)).view(blocks, heads, head_size // 2, tile // head_size)
    return words.permute(0, 3, 1, 2)


def _value_pairs(values: torch.Tensor, head_size: int) -> torch.Tensor:
    """The value half ``[blocks, kv_heads, tile]`` of a cache as a view in canonical order:
    ``[blocks, block_size / 2, 2, kv_heads, head_size]``."""
    return value_tokens(values, head_size).permute(0, 2, 3, 1, 4)


def _canonical_key_words(keys: torch.Tensor) -> torch.Tensor:
    """Canonical keys ``[blocks, block_size, kv_heads, head_size]`` as words, the order of
    :func:`_key_words`."""
    return keys.view(_word(keys.dtype))


def _canonical_value_pairs(values: torch.Tensor) -> torch.Tensor:
    """Canonical values ``[blocks, block_size, kv_heads, head_size]`` as token pairs, the order
    of :func:`_value_pairs`."""
    return values.unflatten(1, (-1, 2))


def _gather(
    kv_cache: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_blocks: int,
    head_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 keys and values ``[seqs, kv_heads, num_blocks * block_size, head_size]`` of each
    row of ``tables``; entries past a sequence's blocks are padding, read as block 0 instead."""
    _, total_blocks, heads, tile = kv_cache.shape
    block_size = tile // head_size
    tables = tables[:, :num_blocks].long()
    used = (seq_lens.long() + block_size - 1) // block_size
    ids = torch.where(torch.arange(num_blocks) < used[:, None], tables, 0)
    # Tiles ordered (sequence, head, block): the gather itself puts heads before blocks.
    tile_ids = (ids[:, None, :] * heads + torch.arange(heads)[:, None]).flatten()
    shape = (tables.shape[0], heads, num_blocks * block_size, head_size)

    def tiles(part: torch.Tensor) -> torch.Tensor:
        return part.view(total_blocks * heads, 1, tile).index_select(0, tile_ids)

    # Key pairs as words: a plain [head_size / 2, block_size] transpose per tile, then upcast.
    word = _word(kv_cache.dtype)
    key_words = tiles(kv_cache[0]).view(word).unflatten(-1, (head_size // 2, block_size))
    keys = key_words.transpose(-1, -2).contiguous().view(kv_cache.dtype).float().view(shape)
    value_pairs = value_tokens(tiles(kv_cache[1]), head_size)
    values = torch.empty(value_pairs.shape, dtype=torch.float32)  # one pass: reorder and upcast
    return keys, values.copy_(value_pairs).view(shape)


def _attend(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """SDPA in float32 (bf16 SDPA on CPU rounds the probabilities to bf16)."""
    return F.scaled_dot_product_attention(
        query.float(), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )


def torch_paged_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    """The fallback: decodes batched into one SDPA call, each prefill chunk its own call with an
    explicit causal mask offset by its cached prefix."""
    out = torch.empty_like(query)
    starts, lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    head_size = query.shape[2]
    block_size = kv_cache.shape[3] // head_size
    q_lens = [starts[i + 1] - starts[i] for i in range(metadata.num_seqs)]
    decodes = [i for i, n in enumerate(q_lens) if n == 1]
    if decodes:
        rows = torch.tensor([starts[i] for i in decodes])
        index = torch.tensor(decodes)
        seq_lens = metadata.seq_lens[index]
        num_blocks = -(-max(lens[i] for i in decodes) // block_size)
        keys, values = _gather(
            kv_cache, metadata.block_tables[index], seq_lens, num_blocks, head_size
        )
        visible = torch.arange(keys.shape[2]) < seq_lens[:, None].long()
        attn = _attend(query[rows].unsqueeze(2), keys, values, visible[:, None, None, :], scale)
        out[rows] = attn.squeeze(2).to(out.dtype)
    for i in (i for i, n in enumerate(q_lens) if n > 1):
        seq_len, q = lens[i], query[starts[i] : starts[i + 1]]
        table, seq_lens = metadata.block_tables[i : i + 1], metadata.seq_lens[i : i + 1]
        keys, values = _gather(kv_cache, table, seq_lens, -(-seq_len // block_size), head_size)
        q_pos = torch.arange(seq_len - q_lens[i], seq_len)[:, None]
        causal = torch.arange(keys.shape[2])[None, :] <= q_pos
        attn = _attend(q.transpose(0, 1).unsqueeze(0), keys, values, causal, scale)
        out[starts[i] : starts[i + 1]] = attn[0].transpose(0, 1)
    return out
