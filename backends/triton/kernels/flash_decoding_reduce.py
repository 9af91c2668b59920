"""Flash-decoding's second stage: combine the split programs' partial outputs of each query
head, weighted by exp2(lse - max), into its output. Over a static cache it reads only the
splits below the row's valid length (see flash_decoding.py, which launches both stages)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def flash_decoding_reduce_kernel(
    o_part_ptr,   # *fp32 [B, Hq, num_splits, Dv] partial outputs of the split kernel
    lse_ptr,      # *fp32 [B, Hq, num_splits] their log2-sum-exp2
    out_ptr,      # *T [B, Hq, 1, Dv] output
    lengths_ptr,  # *i32/i64 [B] valid keys per row; read only if LENGTHS
    stride_ob, stride_oh,  # i32 element strides of out
    stride_lb,    # i32 stride of lengths
    n_q_heads,    # i32 Hq
    num_splits,   # i32 splits per head
    split_len,    # i32 keys per split
    kv_len,       # i32 positions the buffer holds per row
    v_dim,        # i32 Dv
    LENGTHS: tl.constexpr,   # read only the splits below lengths[b]
    BLOCK_S: tl.constexpr,   # power of two >= num_splits
    BLOCK_DV: tl.constexpr,  # power of two >= Dv
):
    bh = tl.program_id(0).to(tl.int64)
    b = bh // n_q_heads
    h = bh % n_q_heads
    splits = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    if LENGTHS:
        row_len = tl.minimum(tl.load(lengths_ptr + b * stride_lb).to(tl.int32), kv_len)
        used = tl.minimum((row_len + split_len - 1) // split_len, num_splits)
    else:
        used = num_splits
    s_valid = splits < used
    lse = tl.load(lse_ptr + bh * num_splits + splits, mask=s_valid, other=float("-inf"))
    # No visible key in any split: every weight is 0 and so is the output (the reference's safe softmax).
    top = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    o = tl.load(o_part_ptr + (bh * num_splits + splits[:, None]) * v_dim + offs_dv[None, :],
                mask=s_valid[:, None] & (offs_dv[None, :] < v_dim), other=0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_dv, out.to(out_ptr.dtype.element_ty),
             mask=offs_dv < v_dim)
