"""``graphopt.rope_kv_cache_update`` in one launch: rotate q and k, write k and v into the cache.

The grid is (token, head block) where the head blocks are laid end to end: first the
query heads (rotated, stored to a fresh output), then the key heads (rotated, stored into
the key cache at ``pos + s``), then the value heads (copied into the value cache). Each
program does one kind of work, chosen by its block index, so a decode step launches one
kernel per layer here instead of four (two rope, two kv_cache_update), and the rotated
keys go from registers to the cache with no intermediate tensor. The position is read
from device memory, so the launch can be captured in a CUDA graph; out-of-range
positions are dropped, as kv_cache_update's kernel drops them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphopt.ops.rope_cache import check_rope_update

from . import _common
from .rope import prune_configs, rotate_rows


@triton.jit
def rope_kv_cache_update_kernel(
    q_ptr, k_ptr, v_ptr,  # *T [B, Hq, S, D], [B, Hkv, S, D], [B, Hkv, S, D] (any strides, unit channel stride)
    cos_ptr, sin_ptr,     # *C [B or 1, S, R] as for graphopt.rope
    q_out_ptr,            # *O [B, Hq, S, D] rotated queries, contiguous
    k_cache_ptr,          # *K key cache, written in place at positions pos .. pos + S - 1
    v_cache_ptr,          # *V value cache, likewise
    pos_ptr,              # *i32/i64 one element: the position of the first new token
    stride_qb, stride_qh, stride_qs,     # i32 strides of q's batch, head, token dims
    stride_kb, stride_kh, stride_ks,     # i32 strides of k
    stride_vb, stride_vh, stride_vs,     # i32 strides of v
    stride_cb,                           # i32 batch stride of cos/sin: 0 when one table serves the batch
    stride_cs,                           # i32 position stride of cos/sin
    stride_kcb, stride_kch, stride_kcs,  # i32 key cache strides of (batch, head, position): bhsd or bshd
    stride_vcb, stride_vch, stride_vcs,  # i32 value cache strides, likewise
    n_q_heads,     # i32 Hq
    n_kv_heads,    # i32 Hkv
    seq_len,       # i32 S (new tokens)
    head_dim,      # i32 D
    rot_dim,       # i32 R: rotary channels (even, <= D)
    max_len,       # i32 positions each cache holds; writes at or past it are dropped
    INTERLEAVED: tl.constexpr,  # pairs (2i, 2i+1) rotate; else halves
    BLOCK_H: tl.constexpr,      # heads per program (power of two, masked)
    BLOCK_D: tl.constexpr,      # power of two >= D
):
    token = tl.program_id(0)
    b = (token // seq_len).to(tl.int64)
    s = (token % seq_len).to(tl.int64)
    block = tl.program_id(1)
    q_blocks = tl.cdiv(n_q_heads, BLOCK_H)
    kv_blocks = tl.cdiv(n_kv_heads, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    in_head = d[None, :] < head_dim
    # [1, 1], not a scalar: the interpreter takes only tensor masks in a store.
    pos = tl.load(pos_ptr + tl.zeros([1, 1], dtype=tl.int32)).to(tl.int64) + s
    pos_ok = (pos >= 0) & (pos < max_len)
    cs = b * stride_cb + s * stride_cs
    if block < q_blocks:
        heads = (block * BLOCK_H + tl.arange(0, BLOCK_H))[:, None].to(tl.int64)
        hmask = heads < n_q_heads
        row = q_ptr + b * stride_qb + s * stride_qs + heads * stride_qh
        out = rotate_rows(row, hmask, cos_ptr + cs, sin_ptr + cs, d, head_dim, rot_dim, INTERLEAVED)
        dst = q_out_ptr + ((b * n_q_heads + heads) * seq_len + s) * head_dim + d[None, :]
        tl.store(dst, out.to(q_out_ptr.dtype.element_ty), mask=hmask & in_head)
    elif block < q_blocks + kv_blocks:
        heads = ((block - q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H))[:, None].to(tl.int64)
        hmask = heads < n_kv_heads
        row = k_ptr + b * stride_kb + s * stride_ks + heads * stride_kh
        out = rotate_rows(row, hmask, cos_ptr + cs, sin_ptr + cs, d, head_dim, rot_dim, INTERLEAVED)
        dst = k_cache_ptr + b * stride_kcb + heads * stride_kch + pos * stride_kcs + d[None, :]
        tl.store(dst, out.to(k_cache_ptr.dtype.element_ty), mask=hmask & in_head & pos_ok)
    else:
        heads = ((block - q_blocks - kv_blocks) * BLOCK_H + tl.arange(0, BLOCK_H))[:, None].to(tl.int64)
        hmask = heads < n_kv_heads
        x = tl.load(v_ptr + b * stride_vb + s * stride_vs + heads * stride_vh + d[None, :], mask=hmask & in_head,
                    other=0.0)
        dst = v_cache_ptr + b * stride_vcb + heads * stride_vch + pos * stride_vcs + d[None, :]
        tl.store(dst, x.to(v_cache_ptr.dtype.element_ty), mask=hmask & in_head & pos_ok)


def gpu_configs(hip: bool) -> list[triton.Config]:
    """rope's tiles (kernels/rope.py): a block of heads of one token per program.

    num_stages=1 and no MI300 knobs: see _common (no loop to pipeline, no tl.dot).
    """
    warp = 64 if hip else 32
    return [triton.Config({"BLOCK_H": bh}, num_warps=threads // warp, num_stages=1)
            for bh in (4, 8, 16) for threads in (128, 256)]


# The writes are idempotent (the same rows to the same positions), so benchmarking configs
# on the live caches is harmless, as for kv_cache_update.
rope_kv_cache_update_tuned = triton.autotune(
    configs=_common.pick_configs(gpu_configs, triton.Config({"BLOCK_H": 4}, num_warps=1, num_stages=1)),
    key=["n_q_heads", "n_kv_heads", "seq_len", "head_dim", "rot_dim", "INTERLEAVED"],
    prune_configs_by={"early_config_prune": prune_configs},
)(rope_kv_cache_update_kernel)


def _cache_strides(cache: Tensor, layout: str) -> tuple[int, int, int]:
    """(batch, head, position) strides of a bhsd or bshd cache."""
    return cache.stride()[:3] if layout == "bhsd" else (cache.stride(0), cache.stride(2), cache.stride(1))


def rope_kv_cache_update(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor,
                         v_cache: Tensor, pos: Tensor, layout: str = "bhsd", interleaved: bool = False) -> Tensor:
    """``graphopt.rope_kv_cache_update``: the caches written in place; returns ``rope(q)``.

    Raises ValueError (the op then runs its reference) for what one launch cannot do
    exactly: a value head size other than the key's, a rotary table not [B or 1, S, R],
    rotated keys that the reference would round twice (to rope's dtype, then the cache's).
    """
    check_rope_update(q, k, v, cos, k_cache, v_cache, pos, layout)
    bsz, n_q_heads, seq_len, head_dim = q.shape
    n_kv_heads, rot_dim = k.shape[1], cos.shape[-1]
    if v.shape[3] != head_dim:
        raise ValueError(f"value head dim {v.shape[3]} differs from the key's {head_dim}")
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[1] != seq_len or cos.shape[0] not in (1, bsz):
        raise ValueError(f"cos/sin must be [{bsz} or 1, {seq_len}, R], got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if rot_dim % 2 or rot_dim > head_dim:
        raise ValueError(f"rotary dim {rot_dim} must be even and <= head dim {head_dim}")
    k_dtype = torch.promote_types(k.dtype, cos.dtype)
    if k_dtype not in (k_cache.dtype, torch.float32):
        raise ValueError(f"rotated keys in {k_dtype} for a {k_cache.dtype} cache would round twice")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the caches must have unit channel stride: they are updated in place, so no copy")
    pos = pos if pos.device == q.device else pos.to(q.device)
    max_len = k_cache.shape[2] if layout == "bhsd" else k_cache.shape[1]
    if pos.device.type == "cpu" and not (0 <= int(pos.reshape(())) <= max_len - seq_len):
        raise ValueError(f"positions [{int(pos.reshape(()))}, {int(pos.reshape(())) + seq_len}) "
                         f"do not fit a cache of {max_len}")
    q_out = torch.empty(q.shape, dtype=torch.promote_types(q.dtype, cos.dtype), device=q.device)
    if q_out.numel() == 0:
        return q_out
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    cos, sin = cos.contiguous(), sin.contiguous()
    stride_cb = 0 if cos.shape[0] == 1 else cos.stride(0)
    grid = lambda meta: (bsz * seq_len, triton.cdiv(n_q_heads, meta["BLOCK_H"])  # noqa: E731
                         + 2 * triton.cdiv(n_kv_heads, meta["BLOCK_H"]))
    rope_kv_cache_update_tuned[grid](
        q, k, v, cos, sin, q_out, k_cache, v_cache, pos, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        stride_cb, cos.stride(1), *_cache_strides(k_cache, layout), *_cache_strides(v_cache, layout),
        n_q_heads, n_kv_heads, seq_len, head_dim, rot_dim, max_len, INTERLEAVED=bool(interleaved),
        BLOCK_D=_common.next_pow2(head_dim))
    return q_out


def aot_specs(name: str, warp: int) -> list[dict]:
    """A Llama decode step in fp16: head dim 128, full rotary, rotate-half, 8 heads per program."""
    signature = {"q_ptr": "*fp16", "k_ptr": "*fp16", "v_ptr": "*fp16", "cos_ptr": "*fp16", "sin_ptr": "*fp16",
                 "q_out_ptr": "*fp16", "k_cache_ptr": "*fp16", "v_cache_ptr": "*fp16", "pos_ptr": "*i64"}
    strides = ("stride_qb", "stride_qh", "stride_qs", "stride_kb", "stride_kh", "stride_ks", "stride_vb",
               "stride_vh", "stride_vs", "stride_cb", "stride_cs", "stride_kcb", "stride_kch", "stride_kcs",
               "stride_vcb", "stride_vch", "stride_vcs")
    for n in (*strides, "n_q_heads", "n_kv_heads", "seq_len", "head_dim", "rot_dim", "max_len"):
        signature[n] = "i32"
    return [dict(fn=rope_kv_cache_update_kernel, signature=signature,
                 constexprs={"INTERLEAVED": False, "BLOCK_H": 8, "BLOCK_D": 128}, num_warps=128 // warp,
                 num_stages=1, divisible=(*strides, "head_dim", "rot_dim"))]
