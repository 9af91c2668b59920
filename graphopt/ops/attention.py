"""Scaled dot-product attention with grouped-query heads."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from graphopt.ops._library import register


def causal_keep_mask(q_len: int, kv_len: int, device: torch.device) -> Tensor:
    """Bottom-right aligned causal mask: query i sees keys j <= i + (kv_len - q_len).

    This is the alignment a KV cache needs (the new queries are the last ones); it
    equals SDPA's top-left ``is_causal`` when q_len == kv_len.
    """
    offset = kv_len - q_len
    rows = torch.arange(q_len, device=device).unsqueeze(-1)
    cols = torch.arange(kv_len, device=device)
    return cols <= rows + offset


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
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap > 0.0:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.float()
    if is_causal:
        keep = causal_keep_mask(q.shape[-2], k.shape[-2], q.device)
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)


@attention.register_fake
def _(q, k, v, mask=None, scale=None, is_causal=False, softcap=0.0):
    if softcap < 0.0:
        raise ValueError(f"softcap {softcap} is negative; pass 0 for no cap")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of kv heads {k.shape[1]}")
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


register("attention")
