"""KV-cache append in place: ``graphopt.kv_cache_update(cache, new, pos, layout, block_table, scales)``.

This is the one graphopt op that mutates its inputs (``cache`` and, for int8 KV,
``scales``): a static cache is written where it lies, so decoding allocates its cache
once and every step has the same shapes. Only ``passes/static_kv_cache.py`` creates it,
on caches owned by ``graphopt.generate`` (see passes/README.md for why that is safe).

``new`` is [B, H, S_new, D]; its rows go to sequence positions ``pos .. pos + S_new - 1``.
``pos`` is a 0-d (or one-element) int64 tensor, so the position is data, not a shape:
one graph serves every decode step. The reference never reads ``pos`` on the host
(no ``.item()``), so it can be captured in a CUDA graph; an out-of-range position fails
inside ``index_copy_``/``index_put_`` (the generate loop checks the bound on the host).

Layouts of ``cache`` (``scales`` has the same layout with D = 1):
- ``bhsd`` [B, H, S_max, D]: the default; attention reads the cache as it is.
- ``bshd`` [B, S_max, H, D]: the layout of the tokens' projections; attention reads a transposed view.
- ``paged`` [num_blocks, H, block_size, D] plus ``block_table`` [B, blocks_per_seq] (int32
  or int64): position p of sequence b lives in block ``block_table[b, p // block_size]``
  at slot ``p % block_size``, so sequences can share one pool of fixed-size blocks.

int8 KV: with ``scales`` given, ``cache`` is int8 and each (token, head) row is quantized
symmetrically, ``q = round(new / s)`` with ``s = max|new| / 127`` stored in ``scales``;
:func:`read_cache` dequantizes. Per-token scales keep an outlier token from crushing the
precision of every other token, which per-tensor scales would.

Readers: ``graphopt.cache_attention`` (graphopt/ops/attention.py) reads the buffers as they
are, up to each row's valid length: int8 with its scales, paged through the block table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import Tensor

from graphopt.ops._library import register

LAYOUTS = ("bhsd", "bshd", "paged")
INT8_MAX = 127.0


def _seq_dim(layout: str) -> int:
    return {"bhsd": 2, "bshd": 1}[layout]


def check_update(cache: Tensor, new: Tensor, pos: Tensor, layout: str, block_table: Tensor | None,
                 scales: Tensor | None) -> None:
    """Raise ValueError, one line, when the arguments do not describe one cache update."""
    if layout not in LAYOUTS:
        raise ValueError(f"kv_cache_update layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    if cache.dim() != 4 or new.dim() != 4:
        raise ValueError(f"kv_cache_update needs 4-D cache and new, got {tuple(cache.shape)} and {tuple(new.shape)}")
    if pos.numel() != 1 or pos.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"kv_cache_update pos must be a one-element int tensor, got {pos.dtype} {tuple(pos.shape)}")
    b, h, _, d = new.shape
    if layout == "paged":
        if block_table is None or block_table.dim() != 2 or block_table.shape[0] != b:
            got = None if block_table is None else tuple(block_table.shape)
            raise ValueError(f"paged kv_cache_update needs a block_table [{b}, blocks_per_seq], got {got}")
        want = (h, d)
        have = (cache.shape[1], cache.shape[3])
    else:
        seq = _seq_dim(layout)
        want = (b, h, d)
        have = (cache.shape[0], cache.shape[3 - seq], cache.shape[3])
    if have != want:
        raise ValueError(f"{layout} cache {tuple(cache.shape)} does not hold new {tuple(new.shape)} "
                         f"(batch/heads/head_dim {have} != {want})")
    if scales is not None:
        if cache.dtype != torch.int8:
            raise ValueError(f"kv_cache_update with scales needs an int8 cache, got {cache.dtype}")
        if tuple(scales.shape) != (*cache.shape[:3], 1):
            raise ValueError(f"int8 scales must be {(*cache.shape[:3], 1)} (the cache with D = 1), "
                             f"got {tuple(scales.shape)}")
    elif cache.dtype == torch.int8:
        raise ValueError("an int8 cache needs its per-token scales; pass scales")


def quantize_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8: ``(q, s)`` with ``x ~= q * s``, s = max|x| / 127 over the last dim."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp_min(1e-12)  # an all-zero row stays zero
    q = torch.round(xf / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def _write(cache: Tensor, rows: Tensor, positions: Tensor, layout: str, block_table: Tensor | None) -> None:
    """Store ``rows`` [B, H, S_new, D'] at ``positions`` [S_new] of ``cache``."""
    rows = rows.to(cache.dtype)
    if layout == "bhsd":
        cache.index_copy_(2, positions, rows)
    elif layout == "bshd":
        cache.index_copy_(1, positions, rows.transpose(1, 2))
    else:
        block_size = cache.shape[2]
        blocks = block_table[:, positions // block_size].long()  # [B, S_new]
        slots = (positions % block_size).expand_as(blocks)
        # Advanced indices on dims 0 and 2 put their [B, S_new] shape first: values are [B, S_new, H, D].
        cache[blocks, :, slots] = rows.permute(0, 2, 1, 3)


@torch.library.custom_op("graphopt::kv_cache_update", mutates_args=("cache", "scales"))
def kv_cache_update(cache: Tensor, new: Tensor, pos: Tensor, layout: str = "bhsd",
                    block_table: Tensor | None = None, scales: Tensor | None = None) -> None:
    """Write ``new`` [B, H, S_new, D] into ``cache`` at positions ``pos .. pos + S_new - 1``, in place.

    ``layout``: ``bhsd`` | ``bshd`` | ``paged`` (needs ``block_table``); ``scales`` makes the
    cache int8 with per-token, per-head scales (written in place too). Returns nothing: a
    custom op may not return an alias of an input, and readers read ``cache`` itself.
    """
    write_update(cache, new, pos, layout, block_table, scales)


def write_update(cache: Tensor, new: Tensor, pos: Tensor, layout: str = "bhsd", block_table: Tensor | None = None,
                 scales: Tensor | None = None) -> None:
    """The reference of ``graphopt.kv_cache_update`` (and of ``graphopt.rope_kv_cache_update``'s writes)."""
    check_update(cache, new, pos, layout, block_table, scales)
    positions = pos.reshape(()).to(device=cache.device, dtype=torch.long) + torch.arange(
        new.shape[2], device=cache.device)
    if scales is None:
        _write(cache, new, positions, layout, block_table)
        return
    q, s = quantize_int8(new)
    _write(cache, q, positions, layout, block_table)
    _write(scales, s, positions, layout, block_table)


@kv_cache_update.register_fake
def _(cache, new, pos, layout="bhsd", block_table=None, scales=None):
    check_update(cache, new, pos, layout, block_table, scales)
    return None


def _bump_versions_with_defaults_filled(op) -> None:
    """torch 2.11-2.12's ADInplaceOrView kernel for a custom op indexes the mutated arguments
    by their schema position without filling defaults, so a call that leaves out ``scales``
    (the last, defaulted, argument) raises IndexError. torch 2.13 fills the defaults first;
    register that behaviour on older torch: bump the version of each written tensor, redispatch."""
    from torch._library import utils as library_utils

    schema = op._opoverload._schema
    mutated_idxs, mutated_keys = library_utils.mutated_args_kwargs(schema)
    after = torch._C._after_ADInplaceOrView_keyset

    def bump_then_redispatch(keyset, *args, **kwargs):
        all_args, all_kwargs = library_utils.fill_defaults(schema, args, kwargs)
        written = [all_args[i] for i in mutated_idxs] + [all_kwargs[k] for k in mutated_keys]
        torch.autograd.graph.increment_version([t for t in written if isinstance(t, Tensor)])
        return op._opoverload.redispatch(keyset & after, *args, **kwargs)

    op._lib.impl(schema.name.split("::")[-1], bump_then_redispatch, "ADInplaceOrView", with_keyset=True,
                 allow_override=True)


if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13):
    _bump_versions_with_defaults_filled(kv_cache_update)


def cache_length(cache: Tensor, layout: str = "bhsd", block_table: Tensor | None = None) -> int:
    """Positions one sequence of ``cache`` holds (paged: its blocks_per_seq whole blocks)."""
    if layout == "bhsd":
        return cache.shape[2]
    if layout == "bshd":
        return cache.shape[1]
    if layout == "paged":
        return block_table.shape[1] * cache.shape[2]
    raise ValueError(f"kv cache layout {layout!r} is not one of {', '.join(LAYOUTS)}")


def read_cache(cache: Tensor, layout: str = "bhsd", block_table: Tensor | None = None,
               scales: Tensor | None = None, dtype: torch.dtype | None = None, length: int | None = None) -> Tensor:
    """Positions ``0 .. length - 1`` (default: all) of the cache as [B, H, length, D] in ``dtype``.

    ``bhsd`` is a slice of the cache and ``bshd`` a transposed slice (no copy); ``paged``
    gathers only the ``ceil(length / block_size)`` blocks that hold those positions; int8
    dequantizes only what it read. So a reader bounded by the valid length pays for that
    length, not for the buffer.
    """
    full = cache_length(cache, layout, block_table)
    length = full if length is None else max(0, min(int(length), full))
    if layout == "bhsd":
        out = cache if length == full else cache[:, :, :length]
    elif layout == "bshd":
        out = (cache if length == full else cache[:, :length]).transpose(1, 2)
    else:
        block = cache.shape[2]
        gathered = cache[block_table[:, :-(-length // block)].long()]  # [B, blocks, H, block, D]
        b, n, h, blk, d = gathered.shape
        out = gathered.permute(0, 2, 1, 3, 4).reshape(b, h, n * blk, d)
        out = out if n * blk == length else out[:, :, :length]
    if scales is not None:
        s = read_cache(scales, layout, block_table, length=length)
        return (out.float() * s.float()).to(dtype or torch.float32)
    return out if dtype is None else out.to(dtype)


def cache_shape(layout: str, batch: int, heads: int, max_length: int, head_dim: int,
                block_size: int = 16) -> tuple[int, ...]:
    """The buffer shape one layer's K (or V) cache has in ``layout``.

    Paged pools get exactly ``batch * ceil(max_length / block_size)`` blocks: one
    contiguous run per sequence is all a single ``generate`` call needs.
    """
    if layout == "bhsd":
        return (batch, heads, max_length, head_dim)
    if layout == "bshd":
        return (batch, max_length, heads, head_dim)
    if layout == "paged":
        blocks = -(-max_length // block_size)
        return (batch * blocks, heads, block_size, head_dim)
    raise ValueError(f"kv cache layout {layout!r} is not one of {', '.join(LAYOUTS)}")


register("kv_cache_update")


# The interface passes/static_kv_cache.py gives the graph it rewrites, for whoever allocates
# the buffers and drives the steps (graphopt.generation.static, graphopt.cuda_graphs).
SPEC_KEY = "graphopt_static_kv_cache"  # graph meta: the StaticCacheSpec


@dataclass
class CacheInput:
    """One static cache input of the rewritten graph (one layer's K or V)."""

    source: str  # the past input it replaces
    index: int  # its position among the rewritten graph's inputs
    shape: tuple[int, ...]
    dtype: torch.dtype
    scales_index: int | None = None  # int8: the position of its scales input
    scales_shape: tuple[int, ...] | None = None


@dataclass
class StaticCacheSpec:
    """The rewritten graph's interface, for whoever allocates the buffers and drives the steps."""

    layout: str
    max_length: int  # positions held per sequence (paged: whole blocks)
    block_size: int
    kv_dtype: str
    new_len: int  # S_new: tokens each call appends
    batch: int
    device: torch.device
    caches: list[CacheInput] = field(default_factory=list)
    pos_index: int = -1
    block_table_index: int | None = None
    block_table_shape: tuple[int, ...] | None = None
    dropped_outputs: list[int] = field(default_factory=list)  # indices of the old outputs removed


def spec_of(gm: fx.GraphModule) -> StaticCacheSpec | None:
    """The interface static_kv_cache gave ``gm``, or None when it did not rewrite it."""
    return getattr(gm, "meta", {}).get(SPEC_KEY)
