"""Attention -> ONNX Runtime's fused attention ops where their interface fits, else standard ops.

``graphopt.attention(q, k, v, mask, scale, is_causal, softcap)`` has q [B, Hq, Sq, D] and k/v
[B, Hkv, Skv, D] (BNSH, Hq a multiple of Hkv), a boolean or additive mask, bottom-right
causal alignment, and an optional tanh cap on the scaled scores. Chosen at export time
from static shapes:

- no mask, Sq and Skv the same length (the same int or the same symbol), Dv == D:
  ``com.microsoft.GroupQueryAttention`` (causal attribute = is_causal, softcap attribute =
  softcap). GQA takes q/k/v as [B, S, H*D]; its ``seqlens_k`` (= total length - 1 per row)
  and ``total_sequence_length`` are computed from k's shape, so the model keeps dynamic
  batch and sequence axes.
- softcap > 0 with a mask, the same lengths and Dv == D: GroupQueryAttention with the mask
  as its ``attention_bias`` input (ORT's CPU kernel caps the scores before adding the bias,
  as the reference does: checked in tests/backends/onnxruntime/test_attention_softcap.py).
  This is how Gemma2's masked layers (causal and sliding-window masks alike) keep their cap.
- no softcap, Dv == D, and either a mask (not causal) or no mask with causality irrelevant
  (not causal, or Sq == 1) and Hq == Hkv: ``com.microsoft.MultiHeadAttention`` with q as
  [B, Sq, H*D] and k/v in their BNSH layout, grouped k/v heads expanded to the query heads
  first (MHA has no kv_num_heads; the model's own repeat_kv did the same before the fusion);
  a mask becomes an additive ``attention_bias`` expanded to [.., .., Sq, Skv] (ORT does not
  broadcast its query axis). MultiHeadAttention has no softcap attribute, so a capped
  attention never takes this route.
- anything else (GQA heads without a mask and a query shorter than the keys, Dv != D,
  causal chunks, a capped attention GQA cannot take): MatMul / Softmax / MatMul in float32
  with k/v heads expanded and Tanh for the cap, the same formula as the reference op.

``graphopt_ort.gqa_with_past`` (made by the backend's lowering from ``attention(q,
cat(past_k, k), cat(past_v, v))``, see ``lowering.py``) -> GroupQueryAttention with its
past_key/past_value inputs and present outputs (and its softcap): decode with a KV cache
in one op.
"""

from __future__ import annotations

import math

import onnx_ir as ir
import torch

from graphopt.backends.onnxruntime.lower import lowering  # noqa: F401  (defines graphopt_ort::gqa_with_past)
from graphopt.backends.onnxruntime.errors import UnsupportedOp
from graphopt.backends.onnxruntime.lower.translations._common import cast_to, const, dims_equal, ms, op, rank, static_dim

graphopt = torch.ops.graphopt
INT32, INT64, FLOAT = ir.DataType.INT32, ir.DataType.INT64, ir.DataType.FLOAT


def _to_bsh(x):
    """[B, H, S, D] -> [B, S, H*D], the layout ORT's attention ops take for the query."""
    return op.Reshape(op.Transpose(x, perm=[0, 2, 1, 3]), [0, 0, -1])


def _from_bsh(x, heads: int, head_dim: int):
    return op.Transpose(op.Reshape(x, [0, 0, heads, head_dim]), perm=[0, 2, 1, 3])


def _seq_len(x):
    """Length of axis 2 of a BNSH tensor as an int32 [1]."""
    return op.Cast(op.Shape(x, start=2, end=3), to=INT32)


def _gqa(q, k, v, past_k, past_v, total, scale, causal: bool, hq: int, hkv: int, d: int,
         softcap: float = 0.0, bias=None):
    """GroupQueryAttention over BNSH q/k/v (+ optional past, + optional additive bias
    [B|1, H|1, Sq, total]); returns (out BNSH, present_k, present_v)."""
    seqlens_k = op.Expand(op.Sub(total, const(1, INT32)), op.Shape(q, start=0, end=1))  # [B]: total - 1 per row
    # Inputs 7-9 (cos/sin caches, position ids) stay absent: rotary ran before the op.
    extra = (None, None, None, bias) if bias is not None else ()
    capped = {"softcap": float(softcap)} if softcap > 0.0 else {}  # 0 is ORT's default: leave it out
    out, present_k, present_v, _qk = ms.GroupQueryAttention(
        _to_bsh(q), _to_bsh(k), _to_bsh(v), past_k, past_v, seqlens_k, op.Reshape(total, []), *extra,
        num_heads=hq, kv_num_heads=hkv, scale=scale, causal=int(causal), **capped,
    )
    return _from_bsh(out, hq, d), present_k, present_v


def _additive_bias(mask, q, k):
    """A boolean or additive mask -> float bias of shape [B|1, H|1, Sq, Skv] in q's dtype."""
    if mask.dtype == ir.DataType.BOOL:
        bias = op.Where(mask, const(0.0, q.dtype), const(_lowest(q.dtype), q.dtype))
    else:  # -inf made finite, as the boolean fill: a row of -inf would be softmax's NaN
        bias = op.Max(cast_to(mask, q.dtype), const(_lowest(q.dtype), q.dtype))
    missing = 4 - (rank(mask) or 4)
    if missing:
        bias = op.Unsqueeze(bias, list(range(missing)))
    target = op.Concat(const([1, 1], INT64), op.Shape(q, start=2, end=3), op.Shape(k, start=2, end=3), axis=0)
    return op.Expand(bias, target)


def attention(q, k, v, mask=None, scale: float | None = None, is_causal: bool = False, softcap: float = 0.0):
    hq, hkv, d, dv = static_dim(q, 1), static_dim(k, 1), static_dim(q, -1), static_dim(v, -1)
    if None in (hq, hkv, d, dv) or rank(q) != 4 or rank(k) != 4:
        raise UnsupportedOp("graphopt.attention", "needs rank-4 q/k/v with static head counts and head sizes")
    if hq % hkv:
        raise UnsupportedOp("graphopt.attention", f"query heads {hq} are not a multiple of kv heads {hkv}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    same_len = dims_equal(q.shape[2], k.shape[2])
    one_query = static_dim(q, 2) == 1
    if d == dv and same_len and (mask is None or softcap > 0.0):
        bias = _additive_bias(mask, q, k) if mask is not None else None
        out, _, _ = _gqa(q, k, v, None, None, _seq_len(k), scale, is_causal, hq, hkv, d, softcap, bias)
        return _zero_empty_rows(out, mask, q.dtype)
    if softcap > 0.0:  # MultiHeadAttention has no softcap attribute
        return _attention_standard(q, k, v, mask, scale, is_causal, hq, hkv, softcap)
    masked = mask is not None and not is_causal
    unmasked_mha = mask is None and hq == hkv and (not is_causal or one_query)
    if d == dv and (masked or unmasked_mha):
        # Grouped heads with a mask: MultiHeadAttention over k/v expanded to the query heads,
        # the repeat the model itself wrote before fuse_attention absorbed it.
        bias = _additive_bias(mask, q, k) if mask is not None else None
        k, v = _expand_heads(k, hq, hkv), _expand_heads(v, hq, hkv)
        out, _, _, _ = ms.MultiHeadAttention(_to_bsh(q), k, v, None, None, bias, num_heads=hq, scale=scale)
        return _zero_empty_rows(_from_bsh(out, hq, dv), mask, q.dtype)
    return _attention_standard(q, k, v, mask, scale, is_causal, hq, hkv)


def _expand_heads(x, hq: int, hkv: int):
    """[B, Hkv, S, D] -> [B, Hq, S, D], each kv head serving Hq/Hkv query heads in order."""
    if hq == hkv:
        return x
    groups = const([1, 1, hq // hkv, 1, 1], INT64)
    return op.Reshape(op.Expand(op.Unsqueeze(x, [2]), groups), [0, hq, -1, static_dim(x, -1)])


def _attention_standard(q, k, v, mask, scale: float, is_causal: bool, hq: int, hkv: int, softcap: float = 0.0):
    out_dtype = q.dtype
    k_full = cast_to(_expand_heads(k, hq, hkv), FLOAT)
    v_full = cast_to(_expand_heads(v, hq, hkv), FLOAT)
    scores = op.Mul(op.MatMul(cast_to(q, FLOAT), op.Transpose(k_full, perm=[0, 1, 3, 2])), const(scale, FLOAT))
    if softcap > 0.0:
        cap = const(float(softcap), FLOAT)
        scores = op.Mul(op.Tanh(op.Div(scores, cap)), cap)
    neg_inf = const(float("-inf"), FLOAT)
    if mask is not None:
        lowest = const(_lowest(FLOAT), FLOAT)  # finite: a row that attends to nothing stays a number
        scores = (op.Where(mask, scores, lowest) if mask.dtype == ir.DataType.BOOL
                  else op.Add(scores, op.Max(cast_to(mask, FLOAT), lowest)))
    if is_causal:
        q_len = op.Reshape(op.Shape(q, start=2, end=3), [])
        kv_len = op.Reshape(op.Shape(k, start=2, end=3), [])
        zero, one = const(0, INT64), const(1, INT64)
        rows = op.Unsqueeze(op.Range(zero, q_len, one), [1])
        cols = op.Range(zero, kv_len, one)
        keep = op.LessOrEqual(cols, op.Add(rows, op.Sub(kv_len, q_len)))  # bottom-right aligned
        scores = op.Where(keep, scores, neg_inf)
    out = _zero_empty_rows(op.MatMul(op.Softmax(scores, axis=-1), v_full), mask, FLOAT)
    return cast_to(out, out_dtype)


def _lowest(dtype) -> float:
    """The most negative finite value of ``dtype``, the fill for a boolean mask's False: with
    -inf a query that attends to nothing (a left pad's row) is NaN, which the next layer
    spreads to every token through 0 * V."""
    wide = {ir.DataType.FLOAT16: torch.float16, ir.DataType.BFLOAT16: torch.bfloat16}.get(dtype, torch.float32)
    return float(torch.finfo(wide).min)


def _zero_empty_rows(out, mask, dtype):
    """``out`` [B, H, Sq, Dv] of ``dtype`` with zeros where ``mask`` (boolean False or additive
    -inf) lets the query attend to nothing: what torch's SDPA (and graphopt.attention) gives such a row."""
    if mask is None:
        return out
    visible = mask if mask.dtype == ir.DataType.BOOL else op.Not(op.IsInf(mask, detect_positive=0))
    keep_any = op.ReduceMax(op.Cast(visible, to=FLOAT), const([-1], INT64), keepdims=1)  # [B|1, H|1, Sq, 1]
    return op.Mul(out, cast_to(keep_any, dtype))


def gqa_with_past(q, k, v, past_k, past_v, scale: float | None = None, softcap: float = 0.0):
    hq, hkv, d = static_dim(q, 1), static_dim(k, 1), static_dim(q, -1)
    if None in (hq, hkv, d) or static_dim(v, -1) != d:
        raise UnsupportedOp("graphopt_ort.gqa_with_past", "needs static head counts and equal k/v head sizes")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    total = op.Add(_seq_len(past_k), _seq_len(k))
    return _gqa(q, k, v, past_k, past_v, total, scale, True, hq, hkv, d, softcap)


TRANSLATIONS = {
    graphopt.attention.default: attention,
    torch.ops.graphopt_ort.gqa_with_past.default: gqa_with_past,
}
