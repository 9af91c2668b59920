"""Prefill attention: FlashAttention-2-style online softmax over KV blocks.

One program owns BLOCK_M queries of one (batch, query head) and streams K/V in
BLOCK_N blocks, keeping a running max and sum so the [Sq, Skv] score matrix never
reaches memory. GQA maps query head h to KV head h // (Hq / Hkv) by pointer
arithmetic (no repeat_interleave copy). Causal masking is bottom-right aligned
(query i sees keys j <= i + Skv - Sq) and also trims the KV loop. Rows that see no
key at all are 0, as the reference gives (torch SDPA's safe softmax), not softmax's nan.
A soft cap (``softcap`` > 0: Gemma2, Grok) bounds the scaled scores to
``cap * tanh(s / cap)`` before the mask; it is a constexpr branch, so uncapped
attention compiles without it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import _common
from ._device import dot

LOG2E = 1.4426950408889634


@triton.jit
def capped_scores(qk, qk_scale, cap_log2e, SOFTCAP: tl.constexpr):
    """Scores in the log2 domain from the raw ``q @ k^T`` tile (fp32).

    Uncapped, ``qk_scale`` is scale * log2(e). Capped, it is 2 * log2(e) * scale / cap and
    ``cap_log2e`` is cap * log2(e), so that ``cap * tanh(qk * scale / cap) * log2(e)`` is
    ``cap_log2e * (1 - 2 / (exp2(qk * qk_scale) + 1))``: no libdevice tanh (it builds for
    both vendors), one exp2 per score like the softmax's, and exp2 overflowing to inf still
    gives the cap, underflowing to 0 its negative.
    """
    if SOFTCAP:
        return cap_log2e - (2.0 * cap_log2e) / (tl.exp2(qk * qk_scale) + 1.0)
    return qk * qk_scale


def score_scales(scale: float, softcap: float) -> tuple[float, float]:
    """(qk_scale, cap_log2e) for :func:`capped_scores`; softcap <= 0 means no cap."""
    if softcap > 0.0:
        return 2.0 * LOG2E * scale / softcap, softcap * LOG2E
    return scale * LOG2E, 0.0


@triton.jit
def flash_attention_kernel(
    q_ptr,        # *T [B, Hq, Sq, D] queries (head dim contiguous)
    k_ptr,        # *T [B, Hkv, Skv, D] keys
    v_ptr,        # *T [B, Hkv, Skv, Dv] values
    mask_ptr,     # *M mask broadcast to [B, Hq, Sq, Skv] by strides; u8 (1 = attend) or additive float
    out_ptr,      # *T [B, Hq, Sq, Dv] output
    stride_qb, stride_qh, stride_qs,  # i32 element strides of q
    stride_kb, stride_kh, stride_ks,  # i32 element strides of k
    stride_vb, stride_vh, stride_vs,  # i32 element strides of v
    stride_mb, stride_mh, stride_mq, stride_mk,  # i32 mask strides, 0 on broadcast dims
    stride_ob, stride_oh, stride_os,  # i32 element strides of out
    n_q_heads,    # i32 Hq
    group,        # i32 Hq / Hkv: query heads per KV head
    q_len,        # i32 Sq
    kv_len,       # i32 Skv
    head_dim,     # i32 D
    v_dim,        # i32 Dv
    qk_scale,     # fp32 softmax scale * log2(e) (the softmax runs on exp2); see capped_scores if SOFTCAP
    cap_log2e,    # fp32 cap * log2(e) if SOFTCAP, else unused
    MASK_KIND: tl.constexpr,  # 0 no mask, 1 boolean (u8), 2 additive
    IS_CAUSAL: tl.constexpr,  # bottom-right aligned causal mask
    SOFTCAP: tl.constexpr,    # cap the scaled scores with tanh before the mask
    BLOCK_M: tl.constexpr,    # queries per program
    BLOCK_N: tl.constexpr,    # keys per loop step
    BLOCK_D: tl.constexpr,    # power of two >= D (>= 16 for tl.dot)
    BLOCK_DV: tl.constexpr,   # power of two >= Dv (>= 16 for tl.dot)
    DOT_F32: tl.constexpr,    # upcast dot operands (only the interpreter with bf16 needs it)
):
    bh = tl.program_id(0)
    start_m = tl.program_id(1) * BLOCK_M
    b = (bh // n_q_heads).to(tl.int64)
    h = (bh % n_q_heads).to(tl.int64)
    kvh = h // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_valid = offs_m < q_len
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
                mask=m_valid[:, None] & (offs_d[None, :] < head_dim), other=0.0)
    k_base = k_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_ptr + b * stride_vb + kvh * stride_vh
    mask_base = mask_ptr + b * stride_mb + h * stride_mh
    causal_shift = kv_len - q_len  # bottom-right alignment: the last query sees every key
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    hi = kv_len
    if IS_CAUSAL:
        # Keys past the block's last query's horizon are masked for every row: skip them.
        hi = tl.minimum(kv_len, start_m + BLOCK_M + causal_shift)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        n_valid = cols < kv_len
        kt = tl.load(k_base + cols[None, :] * stride_ks + offs_d[:, None],
                     mask=n_valid[None, :] & (offs_d[:, None] < head_dim), other=0.0)
        s = capped_scores(dot(q, kt, DOT_F32), qk_scale, cap_log2e, SOFTCAP)
        s = tl.where(n_valid[None, :], s, float("-inf"))
        if MASK_KIND != 0:
            mvals = tl.load(mask_base + offs_m[:, None] * stride_mq + cols[None, :] * stride_mk,
                            mask=m_valid[:, None] & n_valid[None, :], other=0)
            if MASK_KIND == 1:
                s = tl.where(mvals != 0, s, float("-inf"))
            else:
                s = s + mvals.to(tl.float32) * 1.4426950408889634  # additive mask into the log2 domain
        if IS_CAUSAL:
            s = tl.where(cols[None, :] <= offs_m[:, None] + causal_shift, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with no visible key yet has m = -inf; subtracting 0 keeps exp2 at 0, not nan.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + cols[:, None] * stride_vs + offs_dv[None, :],
                    mask=n_valid[:, None] & (offs_dv[None, :] < v_dim), other=0.0)
        # p in V's dtype feeds the tensor cores; p <= 1 so fp16/bf16 keep it to 3 digits.
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_F32)
        m_i = m_new
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # no visible key: acc is 0, so is the row
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_dv[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & (offs_dv[None, :] < v_dim))


def gpu_configs(hip: bool) -> list[triton.Config]:
    """(BLOCK_M, BLOCK_N, warps, stages) per vendor; none spills at head dim 128 (test_aot).

    128x128 tiles, or 128x64 on 4 NVIDIA warps, spill at head dim 128 with a mask.
    """
    if hip:
        # 64-wide wavefronts: 4 waves = 256 threads. A second stage at 128x64 costs ~60
        # VGPRs and spills on gfx942, so only the 32-key tiles pipeline.
        shapes = [(128, 64, 4, 1), (128, 32, 4, 2), (64, 64, 4, 1), (64, 32, 4, 2), (128, 32, 8, 1)]
    else:
        shapes = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 2)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st) for bm, bn, w, st in shapes]


def prune_configs(configs, named_args, warp: int | None = None, **kwargs):
    """On AMD, capped attention keeps only the 32-key tiles: the tanh's temporaries spill at
    64 keys on gfx942 (128x64: 4 bytes, 64x64: 3 at head dim 128; 32-key tiles peak at 248
    VGPRs). NVIDIA keeps every config (212 registers at most, no spill). ``warp`` sizes
    another vendor's configs ahead of time (registry.tuning_specs)."""
    hip = warp == 64 if warp is not None else _common.is_hip()
    if hip and {**named_args, **kwargs}.get("SOFTCAP"):
        return [c for c in configs if c.kwargs["BLOCK_N"] <= 32]
    return configs


# Tuned per head dim and masking mode, not per sequence length: prefill lengths change on
# every request and re-tuning each one would cost more than it saves.
flash_attention_tuned = triton.autotune(
    configs=_common.pick_configs(gpu_configs, triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=1,
                                                            num_stages=1)),
    key=["head_dim", "v_dim", "MASK_KIND", "IS_CAUSAL", "SOFTCAP"],
    prune_configs_by={"early_config_prune": prune_configs})(flash_attention_kernel)


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("attention expects 4-D q, k, v [B, H, S, D]")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not agree")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of kv heads {k.shape[1]}")


def unit_last(*ts: Tensor) -> list[Tensor]:
    """The kernels index the head dim with stride 1; anything else is copied once."""
    return [t if t.stride(-1) == 1 else t.contiguous() for t in ts]


def flash_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, scale: float | None = None,
                    is_causal: bool = False, softcap: float = 0.0, *, out: Tensor | None = None) -> Tensor:
    """``graphopt.attention`` for any Sq (prefill): q [B, Hq, Sq, D], k/v [B, Hkv, Skv, D|Dv]."""
    check_qkv(q, k, v)
    q, k, v = unit_last(q, k, v)
    bsz, n_q_heads, q_len, head_dim = q.shape
    kv_len, v_dim = k.shape[2], v.shape[-1]
    out = _common.output(out, (bsz, n_q_heads, q_len, v_dim), q.dtype, q.device)
    if out.numel() == 0:
        return out
    if kv_len == 0:  # softmax over nothing weights nothing: the reference's matmul gives 0
        return out.zero_()
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    qk_scale, cap_log2e = score_scales(float(scale), float(softcap))
    m, kind, ms = _common.mask_args(mask, (bsz, n_q_heads, q_len, kv_len), q)
    grid = lambda meta: (bsz * n_q_heads, triton.cdiv(q_len, meta["BLOCK_M"]))  # noqa: E731
    flash_attention_tuned[grid](
        q, k, v, m, out, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *ms, *out.stride()[:3],
        n_q_heads, n_q_heads // k.shape[1], q_len, kv_len, head_dim, v_dim, qk_scale, cap_log2e,
        MASK_KIND=kind, IS_CAUSAL=bool(is_causal), SOFTCAP=softcap > 0.0,
        BLOCK_D=max(16, _common.next_pow2(head_dim)), BLOCK_DV=max(16, _common.next_pow2(v_dim)),
        DOT_F32=_common.interpreting() and q.dtype == torch.bfloat16,
    )
    return out


def aot_specs(name: str, warp: int) -> list[dict]:
    """fp16, head dim 128, causal with a contiguous additive mask: the widest path, 128x64 tiles;
    then the same with Gemma2's soft cap, on AMD at the 128x32 tiles ``prune_configs`` leaves it.

    As the JIT would see it: the mask's key stride is 1 (pinned), the other strides and
    the head dims are multiples of 16.
    """
    sig = {n: "*fp16" for n in ("q_ptr", "k_ptr", "v_ptr", "mask_ptr", "out_ptr")}
    for n in ("stride_qb", "stride_qh", "stride_qs", "stride_kb", "stride_kh", "stride_ks", "stride_vb",
              "stride_vh", "stride_vs", "stride_mb", "stride_mh", "stride_mq", "stride_mk", "stride_ob",
              "stride_oh", "stride_os", "n_q_heads", "group", "q_len", "kv_len", "head_dim", "v_dim"):
        sig[n] = "i32"
    sig["qk_scale"] = sig["cap_log2e"] = "fp32"
    constexprs = {"MASK_KIND": 2, "IS_CAUSAL": True, "SOFTCAP": False, "BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_D": 128,
                  "BLOCK_DV": 128, "DOT_F32": False, "stride_mk": 1}
    divisible = tuple(n for n in sig if n.startswith("stride") and n != "stride_mk") + ("head_dim", "v_dim")
    # 256 threads on both vendors; NVIDIA pipelines 3 K/V stages, AMD none at this tile size.
    base = dict(fn=flash_attention_kernel, signature=sig, constexprs=constexprs, num_warps=256 // warp,
                num_stages=3 if warp == 32 else 1, divisible=divisible)
    capped = {**constexprs, "SOFTCAP": True, **({"BLOCK_N": 32} if warp == 64 else {})}
    return [base, {**base, "constexprs": capped, "num_stages": 2 if warp == 64 else base["num_stages"],
                   "label": "softcap"}]
