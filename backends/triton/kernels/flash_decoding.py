"""Decode attention (Sq == 1): split-K flash-decoding over the KV cache, then a reduction.

With one query per head, a program per head has too little work to fill the GPU and
reads K/V once per query head. Here one program takes one KV head, all the query heads
that share it (GQA: K/V are read once for the whole group), and one contiguous split
of the cache; it writes a normalised partial output and its log-sum-exp. A second
kernel weighs the splits by exp(lse - max) and sums them. A soft cap on the scores is the
prefill kernel's (``capped_scores``), behind the same constexpr. Query heads are padded to
16 rows because tl.dot needs M >= 16; decoding is bound by the K/V reads, not by
the wasted MMA rows.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import _common
from ._device import dot
from .flash_attention import capped_scores, check_qkv, score_scales, unit_last


@triton.jit
def flash_decoding_split_kernel(
    q_ptr,        # *T [B, Hq, 1, D] one query per head
    k_ptr,        # *T [B, Hkv, Skv, D] key cache
    v_ptr,        # *T [B, Hkv, Skv, Dv] value cache
    mask_ptr,     # *M mask broadcast to [B, Hq, 1, Skv] by strides; u8 (1 = attend) or additive float
    o_part_ptr,   # *fp32 [B, Hq, num_splits, Dv] each split's normalised partial output
    lse_ptr,      # *fp32 [B, Hq, num_splits] each split's log2-sum-exp2 (-inf if it saw no key)
    stride_qb, stride_qh,             # i32 element strides of q
    stride_kb, stride_kh, stride_ks,  # i32 element strides of k
    stride_vb, stride_vh, stride_vs,  # i32 element strides of v
    stride_mb, stride_mh, stride_mk,  # i32 mask strides, 0 on broadcast dims
    n_kv_heads,   # i32 Hkv
    group,        # i32 Hq / Hkv: query heads per KV head
    kv_len,       # i32 Skv
    head_dim,     # i32 D
    v_dim,        # i32 Dv
    split_len,    # i32 keys per split, a multiple of BLOCK_N
    num_splits,   # i32 splits per head (grid axis 1)
    qk_scale,     # fp32 softmax scale * log2(e) (the softmax runs on exp2); see capped_scores if SOFTCAP
    cap_log2e,    # fp32 cap * log2(e) if SOFTCAP, else unused
    MASK_KIND: tl.constexpr,  # 0 no mask, 1 boolean (u8), 2 additive
    SOFTCAP: tl.constexpr,    # cap the scaled scores with tanh before the mask
    BLOCK_G: tl.constexpr,    # power of two >= group, >= 16 for tl.dot
    BLOCK_N: tl.constexpr,    # keys per loop step
    BLOCK_D: tl.constexpr,    # power of two >= D (>= 16 for tl.dot)
    BLOCK_DV: tl.constexpr,   # power of two >= Dv (>= 16 for tl.dot)
    DOT_F32: tl.constexpr,    # upcast dot operands (only the interpreter with bf16 needs it)
):
    bkv = tl.program_id(0)
    split = tl.program_id(1)
    b = (bkv // n_kv_heads).to(tl.int64)
    kvh = (bkv % n_kv_heads).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    heads = kvh * group + g  # the query heads served by this KV head
    g_valid = g < group
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_valid[:, None] & (offs_d[None, :] < head_dim), other=0.0)
    k_base = k_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_ptr + b * stride_vb + kvh * stride_vh
    mask_base = mask_ptr + b * stride_mb + heads[:, None] * stride_mh
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, kv_len)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        n_valid = cols < hi
        kt = tl.load(k_base + cols[None, :] * stride_ks + offs_d[:, None],
                     mask=n_valid[None, :] & (offs_d[:, None] < head_dim), other=0.0)
        s = capped_scores(dot(q, kt, DOT_F32), qk_scale, cap_log2e, SOFTCAP)
        s = tl.where(n_valid[None, :], s, float("-inf"))
        if MASK_KIND != 0:
            mvals = tl.load(mask_base + cols[None, :] * stride_mk, mask=g_valid[:, None] & n_valid[None, :], other=0)
            if MASK_KIND == 1:
                s = tl.where(mvals != 0, s, float("-inf"))
            else:
                s = s + mvals.to(tl.float32) * 1.4426950408889634  # additive mask into the log2 domain
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A head with no visible key yet has m = -inf; subtracting 0 keeps exp2 at 0, not nan.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + cols[:, None] * stride_vs + offs_dv[None, :],
                    mask=n_valid[:, None] & (offs_dv[None, :] < v_dim), other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_F32)
        m_i = m_new
    seen = l_i > 0.0
    # A split that saw no key contributes weight exp2(-inf) = 0 in the reduction.
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    row = (b * n_kv_heads * group + heads) * num_splits + split  # (b, head, split) in [B, Hq, splits]
    tl.store(lse_ptr + row, lse, mask=g_valid)
    tl.store(o_part_ptr + row[:, None] * v_dim + offs_dv[None, :], o,
             mask=g_valid[:, None] & (offs_dv[None, :] < v_dim))


@triton.jit
def flash_decoding_reduce_kernel(
    o_part_ptr,   # *fp32 [B, Hq, num_splits, Dv] partial outputs of the split kernel
    lse_ptr,      # *fp32 [B, Hq, num_splits] their log2-sum-exp2
    out_ptr,      # *T [B, Hq, 1, Dv] output
    stride_ob, stride_oh,  # i32 element strides of out
    n_q_heads,    # i32 Hq
    num_splits,   # i32 splits per head
    v_dim,        # i32 Dv
    BLOCK_S: tl.constexpr,   # power of two >= num_splits
    BLOCK_DV: tl.constexpr,  # power of two >= Dv
):
    bh = tl.program_id(0).to(tl.int64)
    b = bh // n_q_heads
    h = bh % n_q_heads
    splits = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    s_valid = splits < num_splits
    lse = tl.load(lse_ptr + bh * num_splits + splits, mask=s_valid, other=float("-inf"))
    # If every split is -inf (no visible key) this is nan, as the reference's softmax is.
    w = tl.exp2(lse - tl.max(lse, axis=0))
    o = tl.load(o_part_ptr + (bh * num_splits + splits[:, None]) * v_dim + offs_dv[None, :],
                mask=s_valid[:, None] & (offs_dv[None, :] < v_dim), other=0.0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_dv, out.to(out_ptr.dtype.element_ty),
             mask=offs_dv < v_dim)


# The launcher sizes splits in keys, so BLOCK_N is fixed rather than tuned.
BLOCK_N = 16 if _common.interpreting() else 64
MAX_SPLITS = 64


def gpu_configs(hip: bool) -> list[triton.Config]:
    """128 or 256 threads; deeper K/V pipelines on NVIDIA, 1-2 stages on AMD."""
    warp, stages = (64, (1, 2)) if hip else (32, (2, 3, 4))
    return [triton.Config({}, num_warps=threads // warp, num_stages=st) for threads in (128, 256) for st in stages]


flash_decoding_split_tuned = triton.autotune(
    configs=_common.pick_configs(gpu_configs, triton.Config({}, num_warps=1, num_stages=1)),
    key=["head_dim", "v_dim", "BLOCK_G", "MASK_KIND", "SOFTCAP"])(flash_decoding_split_kernel)


def default_num_splits(batch_kv_heads: int, kv_len: int, device: torch.device) -> int:
    """Enough programs for about two waves over the device's compute units."""
    units = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    return max(1, min(MAX_SPLITS, triton.cdiv(2 * units, batch_kv_heads), triton.cdiv(kv_len, BLOCK_N)))


def flash_decoding(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, scale: float | None = None,
                   softcap: float = 0.0, *, num_splits: int | None = None, out: Tensor | None = None) -> Tensor:
    """``graphopt.attention`` for one query per head (decode), split over the KV cache.

    ``num_splits`` is an upper bound; splits are whole BLOCK_N blocks and no split is
    left empty. is_causal needs no argument: bottom-right aligned, a single query
    sees every key.
    """
    check_qkv(q, k, v)
    if q.shape[2] != 1:
        raise ValueError(f"flash_decoding takes one query per head, got Sq = {q.shape[2]}")
    q, k, v = unit_last(q, k, v)
    bsz, n_q_heads, _, head_dim = q.shape
    n_kv_heads, kv_len, v_dim = k.shape[1], k.shape[2], v.shape[-1]
    group = n_q_heads // n_kv_heads
    out = _common.output(out, (bsz, n_q_heads, 1, v_dim), q.dtype, q.device)
    if out.numel() == 0:
        return out
    if kv_len == 0:  # softmax over nothing weights nothing: the reference's matmul gives 0
        return out.zero_()
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if num_splits is None:
        num_splits = default_num_splits(bsz * n_kv_heads, kv_len, q.device)
    num_splits = max(1, min(int(num_splits), MAX_SPLITS))
    split_len = triton.cdiv(triton.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    num_splits = triton.cdiv(kv_len, split_len)
    o_part = torch.empty((bsz, n_q_heads, num_splits, v_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((bsz, n_q_heads, num_splits), dtype=torch.float32, device=q.device)
    m, kind, ms = _common.mask_args(mask, (bsz, n_q_heads, 1, kv_len), q)
    block_dv = max(16, _common.next_pow2(v_dim))
    flash_decoding_split_tuned[(bsz * n_kv_heads, num_splits)](
        q, k, v, m, o_part, lse, q.stride(0), q.stride(1), *k.stride()[:3], *v.stride()[:3], ms[0], ms[1], ms[3],
        n_kv_heads, group, kv_len, head_dim, v_dim, split_len, num_splits, *score_scales(float(scale), float(softcap)),
        MASK_KIND=kind, SOFTCAP=softcap > 0.0, BLOCK_G=max(16, _common.next_pow2(group)), BLOCK_N=BLOCK_N,
        BLOCK_D=max(16, _common.next_pow2(head_dim)), BLOCK_DV=block_dv,
        DOT_F32=_common.interpreting() and q.dtype == torch.bfloat16,
    )
    flash_decoding_reduce_kernel[(bsz * n_q_heads,)](
        o_part, lse, out, out.stride(0), out.stride(1), n_q_heads, num_splits, v_dim,
        BLOCK_S=_common.next_pow2(num_splits), BLOCK_DV=block_dv, num_warps=1 if _common.interpreting() else 2,
    )
    return out


def aot_specs(name: str, warp: int) -> list[dict]:
    """fp16, head dim 128, GQA group 8 (Llama-3 8B), boolean mask; then the reduction over 16 splits;
    then the split kernel again with Gemma2's soft cap.

    As the JIT would see it: the mask's key stride is 1 (pinned), the other strides, the
    head dims and the split length are multiples of 16.
    """
    sig = {"q_ptr": "*fp16", "k_ptr": "*fp16", "v_ptr": "*fp16", "mask_ptr": "*u8", "o_part_ptr": "*fp32",
           "lse_ptr": "*fp32"}
    for n in ("stride_qb", "stride_qh", "stride_kb", "stride_kh", "stride_ks", "stride_vb", "stride_vh",
              "stride_vs", "stride_mb", "stride_mh", "stride_mk", "n_kv_heads", "group", "kv_len", "head_dim",
              "v_dim", "split_len", "num_splits"):
        sig[n] = "i32"
    sig["qk_scale"] = sig["cap_log2e"] = "fp32"
    split = dict(fn=flash_decoding_split_kernel, signature=sig,
                 constexprs={"MASK_KIND": 1, "SOFTCAP": False, "BLOCK_G": 16, "BLOCK_N": 64, "BLOCK_D": 128, "BLOCK_DV": 128,
                             "DOT_F32": False, "stride_mk": 1},
                 num_warps=128 // warp, num_stages=3 if warp == 32 else 2,
                 divisible=tuple(n for n in sig if n.startswith("stride") and n != "stride_mk")
                 + ("head_dim", "v_dim", "split_len"))
    reduce_sig = {"o_part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*fp16", "stride_ob": "i32",
                  "stride_oh": "i32", "n_q_heads": "i32", "num_splits": "i32", "v_dim": "i32"}
    reduce = dict(fn=flash_decoding_reduce_kernel, signature=reduce_sig,
                  constexprs={"BLOCK_S": 16, "BLOCK_DV": 128}, num_warps=max(1, 64 // warp), num_stages=1,
                  divisible=("stride_ob", "stride_oh", "v_dim"))
    capped = {**split, "constexprs": {**split["constexprs"], "SOFTCAP": True}, "label": "softcap"}
    return [split, reduce, capped]
