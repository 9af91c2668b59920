"""Norms -> ONNX Runtime's fused normalisation ops.

- ``graphopt.rms_norm`` -> ``SimplifiedLayerNormalization`` (ORT, default domain)
- ``graphopt.add_rms_norm`` -> ``com.microsoft.SkipSimplifiedLayerNormalization``
  (its outputs are output, mean, inv_std_var, input_skip_bias_sum: we read 0 and 3)
- ``graphopt.layer_norm`` -> ``LayerNormalization``
- ``graphopt.add_layer_norm`` -> ``com.microsoft.SkipLayerNormalization``
- ``graphopt.softmax_rms_norm`` -> ``Softmax`` + ``SimplifiedLayerNormalization``

All of them normalise the last axis with float32 statistics (``stash_type=1``, which the
Skip ops always do), as graphopt's reference ops do. ``weight_offset`` (Gemma's ``1 + w``)
becomes ``Add(weight, offset)`` on the constant weight, which constant folding turns into
a new weight. A missing weight is a constant of ones (the fused ops need a scale).

Where a fused op cannot take the call as it is, the standard-op form is emitted instead
(same numbers, fewer fusions): weight and input of different dtypes (the reference rounds
the normalised value to x's dtype before scaling, the fused op would not), Skip ops on
inputs that are not 2-D/3-D or whose two addends differ in shape.
"""

from __future__ import annotations

import onnx_ir as ir
import torch

from graphopt.backends.onnxruntime.lower.translations._common import (
    annotate, cast_to, const, ms, ones_like_last_dim, op, promote, rank, same_shape,
)

graphopt = torch.ops.graphopt


def _scale(x, weight, weight_offset: float):
    """The scale the fused op multiplies by, or None when the dtypes make it unusable."""
    if weight is None:
        return ones_like_last_dim(x)
    if weight.dtype != x.dtype:
        return None
    return op.Add(weight, weight_offset) if weight_offset else weight


def _apply_mixed_weight(normed, x, weight, weight_offset: float, bias=None):
    """``normed * (weight + offset) [+ bias]`` in the promoted dtype (mixed-dtype fallback)."""
    out_dtype = promote(x, weight, bias)
    w = cast_to(weight, out_dtype)
    if weight_offset:
        w = op.Add(w, const(weight_offset, out_dtype))
    result = op.Mul(cast_to(normed, out_dtype), w)
    return op.Add(result, cast_to(bias, out_dtype)) if bias is not None else result


def _simplified(x, scale, eps: float):
    y, _ = op.SimplifiedLayerNormalization(x, scale, epsilon=eps, axis=-1, stash_type=1)
    return y


def rms_norm(x, weight, eps: float, weight_offset: float = 0.0):
    scale = _scale(x, weight, weight_offset)
    if scale is None:
        return _apply_mixed_weight(_simplified(x, ones_like_last_dim(x), eps), x, weight, weight_offset)
    return _simplified(x, scale, eps)


def _skip_fits(x, residual) -> bool:
    # ORT's Skip*LayerNormalization take [B, S, H] or [T, H] inputs of the same shape.
    return rank(x) in (2, 3) and same_shape(x, residual) and x.dtype == residual.dtype


def _sum(x, residual):
    """``x + residual`` with torch's promotion, annotated with its dtype (and shape, when the
    two have the same one) so the norm after it can choose its form."""
    dtype = promote(x, residual)
    total = op.Add(cast_to(x, dtype), cast_to(residual, dtype))
    total.dtype = dtype
    if same_shape(x, residual):
        annotate(total, x)
        total.dtype = dtype
    return total


def add_rms_norm(x, residual, weight, eps: float, weight_offset: float = 0.0):
    scale = _scale(x, weight, weight_offset)
    if scale is None or not _skip_fits(x, residual):
        total = _sum(x, residual)
        return rms_norm(total, weight, eps, weight_offset), total
    out, _mean, _inv_std, total = ms.SkipSimplifiedLayerNormalization(x, residual, scale, epsilon=eps)
    return out, total


def softmax_rms_norm(x, weight, eps: float, weight_offset: float = 0.0):
    # The reference takes the softmax in float32 and rounds it to x's dtype.
    probs = cast_to(op.Softmax(cast_to(x, ir.DataType.FLOAT), axis=-1), x.dtype)
    return rms_norm(annotate(probs, x), weight, eps, weight_offset)


def layer_norm(x, weight, bias, eps: float):
    if (weight is not None and weight.dtype != x.dtype) or (bias is not None and bias.dtype != x.dtype):
        normed, _, _ = op.LayerNormalization(x, ones_like_last_dim(x), None, axis=-1, epsilon=eps, stash_type=1)
        if weight is None:
            out_dtype = promote(x, bias)
            return op.Add(cast_to(normed, out_dtype), cast_to(bias, out_dtype))
        return _apply_mixed_weight(normed, x, weight, 0.0, bias)
    scale = weight if weight is not None else ones_like_last_dim(x)
    y, _, _ = op.LayerNormalization(x, scale, bias, axis=-1, epsilon=eps, stash_type=1)
    return y


def add_layer_norm(x, residual, weight, bias, eps: float):
    same_dtype = all(t is None or t.dtype == x.dtype for t in (weight, bias))
    if not same_dtype or not _skip_fits(x, residual):
        total = _sum(x, residual)
        return layer_norm(total, weight, bias, eps), total
    scale = weight if weight is not None else ones_like_last_dim(x)
    out, _mean, _inv_std, total = ms.SkipLayerNormalization(x, residual, scale, bias, epsilon=eps)
    return out, total


TRANSLATIONS = {
    graphopt.rms_norm.default: rms_norm,
    graphopt.add_rms_norm.default: add_rms_norm,
    graphopt.softmax_rms_norm.default: softmax_rms_norm,
    graphopt.layer_norm.default: layer_norm,
    graphopt.add_layer_norm.default: add_layer_norm,
}
