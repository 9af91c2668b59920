"""KV-cache append in place: ``graphopt.kv_cache_update`` (graphopt/ops/kv_cache.py).

One program writes BLOCK_S new tokens of one (batch, head) as a [BLOCK_S, D] tile.
Every layout is the same kernel with different strides: ``bhsd`` and ``bshd`` differ
only in which cache stride walks the sequence, and ``paged`` looks each token's block
up in the block table. The position is read from device memory, never on the host,
so an update can be captured in a CUDA graph like the reference. int8 caches quantize
each (token, head) row on the way in, with the reference's symmetric per-row scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphopt.ops.kv_cache import check_update

from . import _common


@triton.jit
def kv_cache_update_kernel(
    cache_ptr,     # *T cache, written in place: [B, H, Smax, D] (bhsd), [B, Smax, H, D] (bshd) or paged blocks
    new_ptr,       # *S [B, H, Snew, D] new keys or values (any strides, unit channel stride)
    pos_ptr,       # *i32/i64 one element: the sequence position of new's first token
    table_ptr,     # *i32/i64 [B, blocks_per_seq] block table; read only if PAGED
    scales_ptr,    # *fp32 per-(token, head) scales laid out like the cache with D = 1; only if QUANT
    stride_cb, stride_ch, stride_cs,  # i32 cache strides of (batch or block, head, position or slot)
    stride_nb, stride_nh, stride_ns,  # i32 strides of new's batch, head and token dims
    stride_tb,     # i32 row stride of the block table
    stride_sb, stride_sh, stride_ss,  # i32 scales strides, as the cache's
    n_heads,       # i32 H
    new_len,       # i32 Snew
    head_dim,      # i32 D
    max_len,       # i32 positions the cache holds per sequence; writes at or past it are dropped
    block_size,    # i32 tokens per paged block (unused unless PAGED)
    PAGED: tl.constexpr,    # look positions up in the block table
    QUANT: tl.constexpr,    # int8 cache: quantize rows and store their scales
    BLOCK_S: tl.constexpr,  # tokens per program
    BLOCK_D: tl.constexpr,  # power of two >= D
):
    bh = tl.program_id(0)
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    pos = tl.load(pos_ptr).to(tl.int64) + s
    # An out-of-range position is dropped, not written past the cache: the host cannot
    # check it without a sync, and the generate loop bounds it already.
    row_ok = (s < new_len) & (pos >= 0) & (pos < max_len)
    mask = row_ok[:, None] & (d[None, :] < head_dim)
    x = tl.load(new_ptr + b * stride_nb + h * stride_nh + s[:, None].to(tl.int64) * stride_ns + d[None, :],
                mask=mask, other=0.0)
    if PAGED:
        block = tl.load(table_ptr + b * stride_tb + pos // block_size, mask=row_ok, other=0).to(tl.int64)
        slot = pos % block_size
    else:
        block = b
        slot = pos
    if QUANT:
        xf = x.to(tl.float32)
        # s = max|x| / 127 per row (an all-zero row keeps a tiny scale and stays zero).
        scale = tl.maximum(tl.max(tl.abs(xf), axis=1) / 127.0, 1e-12)
        v = tl.math.div_rn(xf, scale[:, None])  # IEEE division, as torch's x / s
        r = tl.floor(v + 0.5)
        # torch.round rounds halves to even: pull odd results of exact ties back down.
        r = tl.where((r - v == 0.5) & (r - 2.0 * tl.floor(r * 0.5) != 0.0), r - 1.0, r)
        vals = tl.minimum(tl.maximum(r, -127.0), 127.0)
        tl.store(scales_ptr + block * stride_sb + h * stride_sh + slot * stride_ss, scale, mask=row_ok)
    else:
        vals = x
    dst = cache_ptr + (block * stride_cb + h * stride_ch + slot * stride_cs)[:, None] + d[None, :]
    tl.store(dst, vals.to(cache_ptr.dtype.element_ty), mask=mask)


def gpu_configs(hip: bool) -> list[triton.Config]:
    """1-16 tokens per program (decode writes one) on 128 or 256 threads."""
    warp = 64 if hip else 32
    return [triton.Config({"BLOCK_S": bs}, num_warps=threads // warp, num_stages=1)
            for bs in (1, 4, 16) for threads in (128, 256)]


# The update is idempotent, so benchmarking configs on the live cache is harmless. The
# number of new tokens is in the key: a prompt of hundreds and a decode step of one want
# different BLOCK_S, and the first call's choice must not stick to the other.
kv_cache_update_tuned = triton.autotune(
    configs=_common.pick_configs(gpu_configs, triton.Config({"BLOCK_S": 4}, num_warps=1, num_stages=1)),
    key=["head_dim", "new_len", "PAGED", "QUANT"])(kv_cache_update_kernel)


def kv_cache_update(cache: Tensor, new: Tensor, pos: Tensor | int, layout: str = "bhsd",
                    block_table: Tensor | None = None, scales: Tensor | None = None) -> None:
    """``graphopt.kv_cache_update``: write ``new`` [B, H, Snew, D] into ``cache`` at ``pos``.., in place.

    ``pos`` is a one-element int tensor (read on the device) or a Python int (checked
    here against the cache's length).
    """
    if not isinstance(pos, Tensor):
        pos = torch.tensor([int(pos)], dtype=torch.int64, device=cache.device)
    check_update(cache, new, pos, layout, block_table, scales)
    bsz, n_heads, new_len, head_dim = new.shape
    if cache.stride(-1) != 1:
        raise ValueError("the cache must have unit channel stride: it is updated in place, so no copy")
    if pos.device != cache.device:
        pos = pos.to(cache.device)
    if layout == "paged":
        max_len = block_table.shape[1] * cache.shape[2]
        strides, table = (cache.stride(0), cache.stride(1), cache.stride(2)), block_table
    elif layout == "bshd":
        max_len = cache.shape[1]
        strides, table = (cache.stride(0), cache.stride(2), cache.stride(1)), pos
    else:
        max_len = cache.shape[2]
        strides, table = cache.stride()[:3], pos
    if pos.device.type == "cpu" and not (0 <= int(pos.reshape(())) <= max_len - new_len):
        # A host position costs nothing to check; a device one is left to the generate loop.
        raise ValueError(f"positions [{int(pos.reshape(()))}, {int(pos.reshape(())) + new_len}) "
                         f"do not fit a cache of {max_len}")
    if bsz * n_heads * new_len == 0:
        return None
    new = new if new.stride(-1) == 1 else new.contiguous()
    sc = scales if scales is not None else pos
    sc_strides = (0, 0, 0)
    if scales is not None:
        sc_strides = ((scales.stride(0), scales.stride(2), scales.stride(1)) if layout == "bshd"
                      else scales.stride()[:3])
    grid = lambda meta: (bsz * n_heads, triton.cdiv(new_len, meta["BLOCK_S"]))  # noqa: E731
    kv_cache_update_tuned[grid](
        cache, new, pos, table, sc, *strides, *new.stride()[:3], table.stride(0) if layout == "paged" else 0,
        *sc_strides, n_heads, new_len, head_dim, max_len, cache.shape[2] if layout == "paged" else 1,
        PAGED=layout == "paged", QUANT=scales is not None, BLOCK_D=_common.next_pow2(head_dim))
    return None


def aot_specs(name: str, warp: int) -> list[dict]:
    """fp16 into a paged fp16 cache (the block-table path), head dim 128, 16 tokens per program;
    then fp16 into an int8 bhsd cache (the quantizing path).

    As the JIT would see it: every stride but the block table's is a multiple of 16.
    """
    sig = {"cache_ptr": "*fp16", "new_ptr": "*fp16", "pos_ptr": "*i64", "table_ptr": "*i32",
           "scales_ptr": "*fp32"}
    for n in ("stride_cb", "stride_ch", "stride_cs", "stride_nb", "stride_nh", "stride_ns", "stride_tb",
              "stride_sb", "stride_sh", "stride_ss", "n_heads", "new_len", "head_dim", "max_len", "block_size"):
        sig[n] = "i32"
    divisible = ("stride_cb", "stride_ch", "stride_cs", "stride_nb", "stride_nh", "stride_ns", "head_dim",
                 "block_size")
    paged = dict(fn=kv_cache_update_kernel, signature=sig,
                 constexprs={"PAGED": True, "QUANT": False, "BLOCK_S": 16, "BLOCK_D": 128},
                 num_warps=256 // warp, num_stages=1, divisible=divisible)
    int8 = dict(paged, signature={**sig, "cache_ptr": "*i8"},
                constexprs={"PAGED": False, "QUANT": True, "BLOCK_S": 16, "BLOCK_D": 128}, label="int8 bhsd")
    return [paged, int8]
