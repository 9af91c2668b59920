"""``graphopt.attention`` lowering: flash-decoding for one query per head, else flash prefill."""

from __future__ import annotations

from torch import Tensor

from .flash_attention import flash_attention
from .flash_decoding import flash_decoding


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, scale: float | None = None,
              is_causal: bool = False, softcap: float = 0.0, *, out: Tensor | None = None) -> Tensor:
    """``graphopt.attention``: q [B, Hq, Sq, D], k/v [B, Hkv, Skv, D|Dv], optional mask, GQA,
    optional soft cap on the scores.

    Sq == 1 goes to split-K flash-decoding, which needs no causal handling: with
    bottom-right alignment the single query sees every key.
    """
    # The graph pass relates k's and v's lengths without a guard (passes/_attention_operands.py),
    # and the kernels read v at k's length: here is where a mismatch must fail.
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"attention: k has {k.shape[-2]} positions and v {v.shape[-2]}; they must be equal")
    if q.dim() == 4 and q.shape[2] == 1:
        return flash_decoding(q, k, v, mask, scale, softcap, out=out)
    return flash_attention(q, k, v, mask, scale, is_causal, softcap, out=out)
