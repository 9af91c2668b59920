"""Scaled dot-product attention with grouped-query heads."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from graphopt.ops._library import register
from graphopt.ops.kv_cache import LAYOUTS, cache_length, read_cache


def causal_keep_mask(q_len: int, kv_len: int, device: torch.device) -> Tensor:
    """Bottom-right aligned causal mask: query i sees keys j <= i + (kv_len - q_len).

    This is the alignment a KV cache needs (the new queries are the last ones); it
    equals SDPA's top-left ``is_causal`` when q_len == kv_len.
    """
    offset = kv_len - q_len
    rows = torch.arange(q_len, device=device).unsqueeze(-1)
    cols = torch.arange(kv_len, device=device)
    return cols <= rows + offset


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, scale: float | None = None,
           is_causal: bool = False, softcap: float = 0.0) -> Tensor:
    """The plain-torch body of :func:`attention` (also what :func:`cache_attention` computes with).

    Grouped heads are computed as views (q as [B, Hkv, G * Sq, D] against each K/V head),
    so K and V are read once per KV head and never copied G times.
    """
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    groups = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qg = q.float().reshape(b, hkv, groups * sq, d)
    scores = (torch.matmul(qg, k.float().transpose(-1, -2)) * scale).view(b, hq, sq, skv)
    if softcap > 0.0:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.float()
    if is_causal:
        keep = causal_keep_mask(sq, skv, q.device)
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if mask is not None or is_causal:
        # A query that may attend to nothing (a left pad's row) gets zeros, as torch's SDPA gives
        # (its safe softmax), not softmax's NaN: the NaN would reach every later token through
        # the next layer's 0 * V.
        probs = probs.masked_fill(scores.isneginf().all(-1, keepdim=True), 0.0)
    probs = probs.reshape(b, hkv, groups * sq, skv)
    return torch.matmul(probs, v.float()).view(b, hq, sq, v.shape[-1]).to(q.dtype)


@torch.library.custom_op("graphopt::attention", mutates_args=())
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    softcap: float = 0.0,
) -> Tensor:
    """``softmax(cap(q k^T * scale) + mask) v`` for q [B, Hq, Sq, D], k/v [B, Hkv, Skv, D|Dv].

    Hq must be a multiple of Hkv (grouped-query attention: each k/v head serves
    Hq / Hkv query heads). ``mask`` is boolean (True = attend) or additive, and
    broadcasts to [B, Hq, Sq, Skv]. ``is_causal`` is bottom-right aligned. The scale
    defaults to 1/sqrt(D). ``softcap`` > 0 bounds the scaled scores to (-softcap, softcap)
    as ``tanh(s / softcap) * softcap`` before the mask (Gemma2's ``attn_logit_softcapping``,
    ONNX Runtime GroupQueryAttention's ``softcap``); 0 leaves them as they are. Scores and
    softmax are computed in float32.
    """
    return attend(q, k, v, mask, scale, is_causal, softcap)


@attention.register_fake
def _(q, k, v, mask=None, scale=None, is_causal=False, softcap=0.0):
    if softcap < 0.0:
        raise ValueError(f"softcap {softcap} is negative; pass 0 for no cap")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of kv heads {k.shape[1]}")
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


register("attention")


def check_cache_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor, layout: str,
                          block_table: Tensor | None, k_scales: Tensor | None, v_scales: Tensor | None) -> None:
    """Raise ValueError, one line, when the arguments do not describe attention over one static cache."""
    if layout not in LAYOUTS:
        raise ValueError(f"cache_attention layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError("cache_attention needs 4-D q [B, Hq, Sq, D] and 4-D caches")
    if lengths.dim() != 1 or lengths.shape[0] != q.shape[0] or lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cache_attention lengths must be int [{q.shape[0]}] (one per row), "
                         f"got {lengths.dtype} {tuple(lengths.shape)}")
    if layout == "paged" and (block_table is None or block_table.dim() != 2 or block_table.shape[0] != q.shape[0]):
        raise ValueError(f"paged cache_attention needs a block_table [{q.shape[0]}, blocks_per_seq]")
    if (k_scales is None) != (v_scales is None):
        raise ValueError("cache_attention takes scales for both caches or for neither")
    if (k_scales is not None) != (k_cache.dtype == torch.int8):
        raise ValueError("an int8 cache is read with its per-token scales, and only an int8 cache has them")
    kv_heads = k_cache.shape[2 if layout == "bshd" else 1]
    if q.shape[1] % kv_heads or q.shape[-1] != k_cache.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} does not match the {layout} cache {tuple(k_cache.shape)} "
                         "(query heads a multiple of kv heads, same head dim)")


def _traced(t: Tensor) -> bool:
    """True while ``t`` has no values to read: fake tensors (passes, make_fx, decomposition),
    dynamo, or a CUDA graph being captured (a host read there would break the capture)."""
    capturing = t.is_cuda and torch.cuda.is_current_stream_capturing()
    return is_fake(t) or torch.compiler.is_compiling() or capturing


@torch.library.custom_op("graphopt::cache_attention", mutates_args=())
def cache_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    lengths: Tensor,
    layout: str = "bhsd",
    block_table: Tensor | None = None,
    k_scales: Tensor | None = None,
    v_scales: Tensor | None = None,
    mask: Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    softcap: float = 0.0,
) -> Tensor:
    """:func:`attention` of q [B, Hq, Sq, D] over a static KV cache, reading only its valid positions.

    Row b's keys are positions ``0 .. lengths[b] - 1`` of the caches (``lengths`` is an int
    tensor [B] on the device, so one graph serves every step); nothing past them is read.
    The caches are read in their own ``layout`` (``bhsd`` | ``bshd`` | ``paged`` through
    ``block_table``), and int8 caches with their per-token ``k_scales``/``v_scales``
    (graphopt/ops/kv_cache.py): a kernel reads the bytes as stored. ``is_causal`` aligns the
    queries to each row's end (query i of row b sits at ``lengths[b] - Sq + i``); ``mask``
    broadcasts to [B, Hq, Sq, S_max] over the whole buffer and is read over the same
    positions. This reference slices the caches to the longest row, read on the host (one
    read per call, which on the CPU is no sync at all), so decode step t costs O(t), and
    masks the shorter rows (zeroing their tails, so garbage past a row's length never
    reaches its output). While tracing or capturing a CUDA graph nothing can be read on the
    host: it masks the whole buffer instead, which computes the same.
    """
    check_cache_attention(q, k_cache, v_cache, lengths, layout, block_table, k_scales, v_scales)
    full = cache_length(k_cache, layout, block_table)
    traced = _traced(lengths)
    bound = full if traced else max(0, min(int(lengths.max()), full))
    # Every row as long as the bound (always so at batch 1): nothing to mask.
    uniform = not traced and (lengths.numel() == 1 or int(lengths.min()) >= bound)
    k = read_cache(k_cache, layout, block_table, k_scales, length=bound)
    v = read_cache(v_cache, layout, block_table, v_scales, length=bound)
    if k_scales is not None and q.dtype != torch.float32:
        k, v = k.to(q.dtype), v.to(q.dtype)
    if uniform and mask is None and softcap == 0.0 and (q.shape[2] == 1 or not is_causal) and bound > 0:
        # The decode step's case: torch's fused CPU/GPU attention, no mask to build (a query at
        # the row's end sees every valid key). Each call is a few dozen microseconds cheaper than
        # the masked form, which matters at the sizes where decoding is bound by overheads.
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    cols = torch.arange(bound, device=q.device)
    ends = lengths.to(q.device, torch.long).view(-1, 1, 1, 1)
    if not traced and not uniform:
        # Rows shorter than the longest: their zero-probability tail must not be garbage
        # (0 * nan is nan), so it is zeroed. Only ragged batches pay; traced graphs keep the
        # plain mask and rely on the buffer's tail being finite (zeros, or earlier tokens).
        valid = (cols < ends.view(-1, 1, 1)).unsqueeze(-1)  # [B, 1, L, 1]
        k, v = k.masked_fill(~valid, 0.0), v.masked_fill(~valid, 0.0)
    if is_causal:
        rows = torch.arange(q.shape[2], device=q.device).view(1, 1, -1, 1)
        keep = cols <= ends - q.shape[2] + rows  # [B, 1, Sq, L]
    else:
        keep = cols < ends  # [B, 1, 1, L]
    if mask is not None:
        mask = mask[..., :bound] if mask.shape[-1] == full else mask
        if mask.dtype == torch.bool:
            mask = mask & keep
        else:
            mask = mask.masked_fill(~keep, float("-inf"))
    else:
        mask = keep
    return attend(q, k, v, mask, scale, False, softcap)


@cache_attention.register_fake
def _(q, k_cache, v_cache, lengths, layout="bhsd", block_table=None, k_scales=None, v_scales=None, mask=None,
      scale=None, is_causal=False, softcap=0.0):
    check_cache_attention(q, k_cache, v_cache, lengths, layout, block_table, k_scales, v_scales)
    if softcap < 0.0:
        raise ValueError(f"softcap {softcap} is negative; pass 0 for no cap")
    return q.new_empty((*q.shape[:-1], v_cache.shape[-1]))


register("cache_attention")
