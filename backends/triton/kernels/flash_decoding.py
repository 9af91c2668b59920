"""Decode attention (Sq == 1): split-K flash-decoding over the KV cache, then a reduction.

With one query per head, a program per head has too little work to fill the GPU and
reads K/V once per query head. Here one program takes one KV head, all the query heads
that share it (GQA: K/V are read once for the whole group), and one contiguous split
of the cache; it writes a normalised partial output and its log-sum-exp. A second
kernel (flash_decoding_reduce.py) weighs the splits by exp(lse - max) and sums them. A
soft cap on the scores is the prefill kernel's (``capped_scores``), behind the same
constexpr. Query heads are padded to 16 rows because tl.dot needs M >= 16; decoding is
bound by the K/V reads, not by the wasted MMA rows.

Over a static cache (``graphopt.cache_attention``) the same kernels take per-row valid
lengths from device memory (so one launch, or one CUDA graph, serves every step): a split
wholly past its row's length loads nothing and stores nothing, the others stop at the
length, and the reduction reads only the splits below it, so step t reads t positions,
not the buffer's max_length (vLLM's paged decode kernel bounds its partitions the same
way). The cache is read as stored: through the block table for the paged layout (each
key's block looked up, no dense copy), and as int8 with per-token scales, dequantized in
the load loop (the K scale multiplies the scores, the V scale the probabilities), so an
int8 cache moves a quarter of fp32's K/V bytes.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphopt.ops.attention import check_cache_attention
from graphopt.ops.kv_cache import cache_length, read_cache

from . import _common
from ._device import dot, int8_to_float
from .flash_decoding_reduce import flash_decoding_reduce_kernel
from .flash_attention import capped_scores, check_qkv, flash_attention, score_scales, unit_last


@triton.jit
def flash_decoding_split_kernel(
    q_ptr,        # *T [B, Hq, 1, D] one query per head
    k_ptr,        # *T [B, Hkv, Skv, D] key cache
    v_ptr,        # *T [B, Hkv, Skv, Dv] value cache
    mask_ptr,     # *M mask broadcast to [B, Hq, 1, Skv] by strides; u8 (1 = attend) or additive float
    o_part_ptr,   # *fp32 [B, Hq, num_splits, Dv] each split's normalised partial output
    lse_ptr,      # *fp32 [B, Hq, num_splits] each split's log2-sum-exp2 (-inf if it saw no key)
    lengths_ptr,  # *i32/i64 [B] valid keys per row; read only if LENGTHS
    table_ptr,    # *i32/i64 [B, blocks_per_seq] block table; read only if PAGED
    ks_ptr,       # *fp32 per-token K scales, laid out like k with D = 1; read only if QUANT
    vs_ptr,       # *fp32 per-token V scales, likewise
    stride_qb, stride_qh,             # i32 element strides of q
    stride_kb, stride_kh, stride_ks,  # i32 element strides of k (PAGED: block, head, slot)
    stride_vb, stride_vh, stride_vs,  # i32 element strides of v (likewise)
    stride_mb, stride_mh, stride_mk,  # i32 mask strides, 0 on broadcast dims
    stride_lb,    # i32 stride of lengths (0 when one length serves every row)
    stride_tb,    # i32 row stride of the block table
    stride_ksb, stride_ksh, stride_kss,  # i32 strides of the K scales
    stride_vsb, stride_vsh, stride_vss,  # i32 strides of the V scales
    block_size,   # i32 positions per paged block (PAGED)
    n_kv_heads,   # i32 Hkv
    group,        # i32 Hq / Hkv: query heads per KV head
    kv_len,       # i32 Skv: positions the buffer holds per row
    head_dim,     # i32 D
    v_dim,        # i32 Dv
    split_len,    # i32 keys per split, a multiple of BLOCK_N
    num_splits,   # i32 splits per head (grid axis 1)
    qk_scale,     # fp32 softmax scale * log2(e) (the softmax runs on exp2); see capped_scores if SOFTCAP
    cap_log2e,    # fp32 cap * log2(e) if SOFTCAP, else unused
    MASK_KIND: tl.constexpr,  # 0 no mask, 1 boolean (u8), 2 additive
    SOFTCAP: tl.constexpr,    # cap the scaled scores with tanh before the mask
    LENGTHS: tl.constexpr,    # bound each row by lengths[b] (a static cache), else by kv_len
    PAGED: tl.constexpr,      # look each key's block up in the block table
    QUANT: tl.constexpr,      # int8 K/V with per-token scales
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
    if LENGTHS:
        row_len = tl.minimum(tl.load(lengths_ptr + b * stride_lb).to(tl.int32), kv_len)
    else:
        row_len = kv_len
    mask_base = mask_ptr + b * stride_mb + heads[:, None] * stride_mh
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    ks_base = ks_ptr + kvh * stride_ksh
    vs_base = vs_ptr + kvh * stride_vsh
    if not PAGED:  # the row's own buffer; a paged key finds its block in the loop
        k_base += b * stride_kb
        v_base += b * stride_vb
        ks_base += b * stride_ksb
        vs_base += b * stride_vsb
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    lo = split * split_len
    # A split past its row's length runs no iteration: it reads no K/V and stores nothing.
    hi = tl.minimum(lo + split_len, row_len)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        n_valid = cols < hi
        if PAGED:
            blk = tl.load(table_ptr + b * stride_tb + cols // block_size, mask=n_valid, other=0).to(tl.int64)
            slot = cols % block_size
            k_off = blk * stride_kb + slot * stride_ks
            v_off = blk * stride_vb + slot * stride_vs
            ks_off = blk * stride_ksb + slot * stride_kss
            vs_off = blk * stride_vsb + slot * stride_vss
        else:
            k_off = cols * stride_ks
            v_off = cols * stride_vs
            ks_off = cols * stride_kss
            vs_off = cols * stride_vss
        kt = tl.load(k_base + k_off[None, :] + offs_d[:, None],
                     mask=n_valid[None, :] & (offs_d[:, None] < head_dim), other=0.0)
        if QUANT:
            # int8 is exact in every float type; its scale multiplies the raw scores instead.
            qk = dot(q, int8_to_float(kt, q.dtype), DOT_F32)
            k_scale = tl.load(ks_base + ks_off, mask=n_valid, other=0.0)
            qk = qk * k_scale[None, :]
        else:
            qk = dot(q, kt, DOT_F32)
        s = capped_scores(qk, qk_scale, cap_log2e, SOFTCAP)
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
        v = tl.load(v_base + v_off[:, None] + offs_dv[None, :],
                    mask=n_valid[:, None] & (offs_dv[None, :] < v_dim), other=0.0)
        if QUANT:
            # sum_j p_j * (s_j * v_j) = sum_j (p_j * s_j) * v_j: the V scale weighs the probabilities.
            v_scale = tl.load(vs_base + vs_off, mask=n_valid, other=0.0)
            acc = acc * alpha[:, None] + dot((p * v_scale[None, :]).to(q.dtype), int8_to_float(v, q.dtype), DOT_F32)
        else:
            acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_F32)
        m_i = m_new
    seen = l_i > 0.0
    # A split that saw no key contributes weight exp2(-inf) = 0 in the reduction.
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    row = (b * n_kv_heads * group + heads) * num_splits + split  # (b, head, split) in [B, Hq, splits]
    if LENGTHS:  # a split past the row's length stores nothing: the reduction never reads it
        live = g_valid & ((g * 0 + lo) < row_len)
    else:
        live = g_valid
    tl.store(lse_ptr + row, lse, mask=live)
    tl.store(o_part_ptr + row[:, None] * v_dim + offs_dv[None, :], o,
             mask=live[:, None] & (offs_dv[None, :] < v_dim))


# The launcher sizes splits in keys, so BLOCK_N is fixed rather than tuned.
BLOCK_N = 16 if _common.interpreting() else 64
MAX_SPLITS = 64


def gpu_configs(hip: bool) -> list[triton.Config]:
    """128 or 256 threads; deeper K/V pipelines on NVIDIA, 1-2 stages on AMD."""
    warp, stages = (64, (1, 2)) if hip else (32, (2, 3, 4))
    return [triton.Config({}, num_warps=threads // warp, num_stages=st) for threads in (128, 256) for st in stages]


def prune_configs(configs, named_args, warp: int | None = None, **kwargs):
    """On AMD the int8 cache keeps only 256 threads without software pipelining: the
    dequantizing loads spill at 128 threads or 2 stages on gfx942 (head dim 128). NVIDIA
    keeps every config. ``warp`` sizes another vendor's configs ahead of time."""
    hip = warp == 64 if warp is not None else _common.is_hip()
    if hip and {**named_args, **kwargs}.get("QUANT"):
        return [c for c in configs if c.num_warps * 64 == 256 and c.num_stages == 1]
    return configs


flash_decoding_split_tuned = triton.autotune(
    configs=_common.pick_configs(gpu_configs, triton.Config({}, num_warps=1, num_stages=1)),
    key=["head_dim", "v_dim", "BLOCK_G", "MASK_KIND", "SOFTCAP", "LENGTHS", "PAGED", "QUANT"],
    prune_configs_by={"early_config_prune": prune_configs})(flash_decoding_split_kernel)


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
    strides = (k.stride()[:3], v.stride()[:3])
    return _decode(q, k, v, strides, k.shape[1], k.shape[2], v.shape[-1], mask, scale, softcap, num_splits, out)


def cache_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor, layout: str = "bhsd",
                    block_table: Tensor | None = None, k_scales: Tensor | None = None, v_scales: Tensor | None = None,
                    mask: Tensor | None = None, scale: float | None = None, is_causal: bool = False,
                    softcap: float = 0.0, *, num_splits: int | None = None, out: Tensor | None = None) -> Tensor:
    """``graphopt.cache_attention`` for one query per head: split-K decoding bounded by each
    row's ``lengths[b]``, reading the caches in their layout and dtype (no dense copy).

    Splits are sized from the buffer (a host value, so the launch is the same every step and
    CUDA-graph capturable); those past a row's length read nothing. A chunk of several
    queries (a prompt) runs flash attention over the valid prefix instead (:func:`_chunk`).
    """
    check_cache_attention(q, k_cache, v_cache, lengths, layout, block_table, k_scales, v_scales)
    if lengths.device != q.device:
        raise ValueError(f"lengths live on {lengths.device}, the caches on {q.device}; keep them together")
    if q.shape[2] != 1:
        return _chunk(q, k_cache, v_cache, lengths, layout, block_table, k_scales, v_scales, mask, scale, is_causal,
                      softcap, out)
    # One query at position lengths[b] - 1 sees every valid key: is_causal changes nothing.
    q, k_cache, v_cache = unit_last(q, k_cache, v_cache)
    if layout == "bshd":  # [B, S, H, D]: walk the sequence with stride 1 and heads with stride 2
        strides = tuple((t.stride(0), t.stride(2), t.stride(1)) for t in (k_cache, v_cache))
        scale_strides = tuple((t.stride(0), t.stride(2), t.stride(1)) if t is not None else (0, 0, 0)
                              for t in (k_scales, v_scales))
        heads = k_cache.shape[2]
    else:  # bhsd, and paged blocks [N, H, block, D] with the block index in place of the batch
        strides = (k_cache.stride()[:3], v_cache.stride()[:3])
        scale_strides = tuple(t.stride()[:3] if t is not None else (0, 0, 0) for t in (k_scales, v_scales))
        heads = k_cache.shape[1]
    full = cache_length(k_cache, layout, block_table)
    return _decode(q, k_cache, v_cache, strides, heads, full, v_cache.shape[-1], mask, scale, softcap, num_splits,
                   out, lengths=lengths, block_table=block_table if layout == "paged" else None,
                   block_size=k_cache.shape[2] if layout == "paged" else 1, scales=(k_scales, v_scales),
                   scale_strides=scale_strides)


def _chunk(q, k_cache, v_cache, lengths, layout, block_table, k_scales, v_scales, mask, scale, is_causal, softcap,
           out) -> Tensor:
    """Several queries per row (a prompt): flash attention over the valid prefix, read densely.

    A chunk comes once per prompt, not per token, so it may read the longest row's length on
    the host and gather (paged) or dequantize (int8) that prefix; rows shorter than it are
    masked per row and their tails zeroed (0 * garbage must not reach the output).
    """
    full = cache_length(k_cache, layout, block_table)
    bound = max(0, min(int(lengths.max()), full))
    k = read_cache(k_cache, layout, block_table, k_scales, dtype=q.dtype, length=bound)
    v = read_cache(v_cache, layout, block_table, v_scales, dtype=q.dtype, length=bound)
    if mask is not None and mask.shape[-1] == full:
        mask = mask[..., :bound]
    if int(lengths.min()) >= bound:  # every row ends at the bound: bottom-right causal is each row's own
        return flash_attention(q, k, v, mask, scale, is_causal, softcap, out=out)
    cols = torch.arange(bound, device=q.device)
    ends = lengths.to(torch.long).view(-1, 1, 1, 1)
    valid = (cols < ends.view(-1, 1, 1)).unsqueeze(-1)
    k, v = k.masked_fill(~valid, 0.0), v.masked_fill(~valid, 0.0)
    rows = torch.arange(q.shape[2], device=q.device).view(1, 1, -1, 1)
    keep = cols <= ends - q.shape[2] + rows if is_causal else cols < ends
    if mask is None:
        mask = keep
    elif mask.dtype == torch.bool:
        mask = mask & keep
    else:
        mask = mask.masked_fill(~keep, float("-inf"))
    return flash_attention(q, k, v, mask, scale, False, softcap, out=out)


def _decode(q, k, v, strides, n_kv_heads, kv_len, v_dim, mask, scale, softcap, num_splits, out, *, lengths=None,
            block_table=None, block_size=1, scales=(None, None), scale_strides=((0, 0, 0), (0, 0, 0))) -> Tensor:
    """Launch the split and reduction kernels; ``k``/``v`` are addressed by ``strides`` of (batch or
    block, head, position or slot) and hold ``kv_len`` positions per row."""
    bsz, n_q_heads, _, head_dim = q.shape
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
    has_len, paged, quant = lengths is not None, block_table is not None, scales[0] is not None
    lens = lengths if has_len else lse  # unread dummies for the pointer arguments off in this launch
    table = block_table if paged else lse
    ks, vs = scales if quant else (lse, lse)
    stride_lb = lengths.stride(0) if has_len else 0
    flash_decoding_split_tuned[(bsz * n_kv_heads, num_splits)](
        q, k, v, m, o_part, lse, lens, table, ks, vs, q.stride(0), q.stride(1), *strides[0], *strides[1],
        ms[0], ms[1], ms[3], stride_lb, block_table.stride(0) if paged else 0, *scale_strides[0],
        *scale_strides[1], block_size, n_kv_heads, group, kv_len, head_dim, v_dim, split_len, num_splits,
        *score_scales(float(scale), float(softcap)),
        MASK_KIND=kind, SOFTCAP=softcap > 0.0, LENGTHS=has_len, PAGED=paged, QUANT=quant,
        BLOCK_G=max(16, _common.next_pow2(group)), BLOCK_N=BLOCK_N,
        BLOCK_D=max(16, _common.next_pow2(head_dim)), BLOCK_DV=block_dv,
        DOT_F32=_common.interpreting() and q.dtype == torch.bfloat16,
    )
    flash_decoding_reduce_kernel[(bsz * n_q_heads,)](
        o_part, lse, out, lens, out.stride(0), out.stride(1), stride_lb, n_q_heads, num_splits, split_len, kv_len,
        v_dim, LENGTHS=has_len, BLOCK_S=_common.next_pow2(num_splits), BLOCK_DV=block_dv,
        num_warps=1 if _common.interpreting() else 2,
    )
    return out


def aot_specs(name: str, warp: int) -> list[dict]:
    """``flash_decoding``: fp16, head dim 128, GQA group 8 (Llama-3 8B), boolean mask; then the
    reduction over 16 splits; then the split kernel again with Gemma2's soft cap.
    ``cache_attention``: the split kernel bounded by per-row lengths over an int8 paged cache
    (block table, per-token scales), the bounded reduction, then over an fp16 bhsd cache.

    As the JIT would see it: the mask's key stride is 1 (pinned), the other strides, the
    head dims and the split length are multiples of 16.
    """
    sig = {"q_ptr": "*fp16", "k_ptr": "*fp16", "v_ptr": "*fp16", "mask_ptr": "*u8", "o_part_ptr": "*fp32",
           "lse_ptr": "*fp32", "lengths_ptr": "*fp32", "table_ptr": "*fp32", "ks_ptr": "*fp32", "vs_ptr": "*fp32"}
    for n in ("stride_qb", "stride_qh", "stride_kb", "stride_kh", "stride_ks", "stride_vb", "stride_vh",
              "stride_vs", "stride_mb", "stride_mh", "stride_mk", "stride_lb", "stride_tb", "stride_ksb",
              "stride_ksh", "stride_kss", "stride_vsb", "stride_vsh", "stride_vss", "block_size", "n_kv_heads",
              "group", "kv_len", "head_dim", "v_dim", "split_len", "num_splits"):
        sig[n] = "i32"
    sig["qk_scale"] = sig["cap_log2e"] = "fp32"
    off = {"LENGTHS": False, "PAGED": False, "QUANT": False}
    divisible = tuple(n for n in ("stride_qb", "stride_qh", "stride_kb", "stride_kh", "stride_ks", "stride_vb",
                                  "stride_vh", "stride_vs", "stride_mb", "stride_mh")) + ("head_dim", "v_dim",
                                                                                         "split_len")
    split = dict(fn=flash_decoding_split_kernel, signature=sig,
                 constexprs={"MASK_KIND": 1, "SOFTCAP": False, **off, "BLOCK_G": 16, "BLOCK_N": 64, "BLOCK_D": 128,
                             "BLOCK_DV": 128, "DOT_F32": False, "stride_mk": 1},
                 num_warps=128 // warp, num_stages=3 if warp == 32 else 2, divisible=divisible)
    reduce_sig = {"o_part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*fp16", "lengths_ptr": "*fp32",
                  "stride_ob": "i32", "stride_oh": "i32", "stride_lb": "i32", "n_q_heads": "i32",
                  "num_splits": "i32", "split_len": "i32", "kv_len": "i32", "v_dim": "i32"}
    reduce = dict(fn=flash_decoding_reduce_kernel, signature=reduce_sig,
                  constexprs={"LENGTHS": False, "BLOCK_S": 16, "BLOCK_DV": 128}, num_warps=max(1, 64 // warp),
                  num_stages=1, divisible=("stride_ob", "stride_oh", "v_dim"))
    if name == "cache_attention":
        cache_sig = {**sig, "k_ptr": "*i8", "v_ptr": "*i8", "lengths_ptr": "*i64", "table_ptr": "*i64"}
        bounded = {"MASK_KIND": 0, "LENGTHS": True, "PAGED": True, "QUANT": True, "stride_lb": 1}
        int8_paged = {**split, "signature": cache_sig, "constexprs": {**split["constexprs"], **bounded},
                      "divisible": divisible + ("block_size",), "label": "int8 paged",
                      **({"num_warps": 4, "num_stages": 1} if warp == 64 else {})}  # what prune_configs leaves AMD
        bounded_reduce = {**reduce, "signature": {**reduce_sig, "lengths_ptr": "*i64"},
                          "constexprs": {**reduce["constexprs"], "LENGTHS": True}, "label": "bounded"}
        fp16_bhsd = {**split, "signature": {**sig, "lengths_ptr": "*i64"},
                     "constexprs": {**split["constexprs"], "MASK_KIND": 0, "LENGTHS": True, "stride_lb": 1},
                     "label": "fp16 bhsd"}
        return [int8_paged, bounded_reduce, fp16_bhsd]
    capped = {**split, "constexprs": {**split["constexprs"], "SOFTCAP": True}, "label": "softcap"}
    return [split, reduce, capped]
