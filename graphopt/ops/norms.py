"""Normalisation ops: RMSNorm, LayerNorm, their residual-add forms, Softmax + RMSNorm.

All of them normalise over the last dimension and accumulate in float32 whatever the
input dtype, as the Triton kernels and ONNX Runtime's fused ops do.
"""

from __future__ import annotations

import torch
from torch import Tensor

from graphopt.ops._library import register


def _rms_norm_ref(x: Tensor, weight: Tensor | None, eps: float, weight_offset: float) -> Tensor:
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    if weight is None:
        return normed
    # Gemma-style models store w and scale by (1 + w): weight_offset carries the 1.
    return normed * (weight + weight_offset) if weight_offset else normed * weight


def _norm_out_dtype(x: Tensor, weight: Tensor | None) -> torch.dtype:
    return x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype)


@torch.library.custom_op("graphopt::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor | None, eps: float, weight_offset: float = 0.0) -> Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps) * (weight + weight_offset)``; stats in float32."""
    return _rms_norm_ref(x, weight, eps, weight_offset)


@rms_norm.register_fake
def _(x, weight, eps, weight_offset=0.0):
    return x.new_empty(x.shape, dtype=_norm_out_dtype(x, weight))


@torch.library.custom_op("graphopt::add_rms_norm", mutates_args=())
def add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, weight_offset: float = 0.0
) -> tuple[Tensor, Tensor]:
    """``s = x + residual``; returns ``(rms_norm(s), s)``: the residual stream needs s."""
    total = x + residual
    return _rms_norm_ref(total, weight, eps, weight_offset), total


@add_rms_norm.register_fake
def _(x, residual, weight, eps, weight_offset=0.0):
    total = torch.empty_like(x + residual)
    return total.new_empty(total.shape, dtype=_norm_out_dtype(total, weight)), total


@torch.library.custom_op("graphopt::softmax_rms_norm", mutates_args=())
def softmax_rms_norm(x: Tensor, weight: Tensor | None, eps: float, weight_offset: float = 0.0) -> Tensor:
    """``rms_norm(softmax(x, -1))``: both reduce over the last axis, so one pass suffices."""
    probs = torch.softmax(x.float(), dim=-1).to(x.dtype)
    return _rms_norm_ref(probs, weight, eps, weight_offset)


@softmax_rms_norm.register_fake
def _(x, weight, eps, weight_offset=0.0):
    return x.new_empty(x.shape, dtype=_norm_out_dtype(x, weight))


def _layer_norm_ref(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    out = torch.nn.functional.layer_norm(x.float(), x.shape[-1:], None, None, eps).to(x.dtype)
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out


def _affine_out_dtype(x: Tensor, weight: Tensor | None, bias: Tensor | None) -> torch.dtype:
    dtype = x.dtype
    for t in (weight, bias):
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


@torch.library.custom_op("graphopt::layer_norm", mutates_args=())
def layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    """LayerNorm over the last dimension; stats in float32."""
    return _layer_norm_ref(x, weight, bias, eps)


@layer_norm.register_fake
def _(x, weight, bias, eps):
    return x.new_empty(x.shape, dtype=_affine_out_dtype(x, weight, bias))


@torch.library.custom_op("graphopt::add_layer_norm", mutates_args=())
def add_layer_norm(
    x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor]:
    """``s = x + residual``; returns ``(layer_norm(s), s)`` (ORT's SkipLayerNormalization)."""
    total = x + residual
    return _layer_norm_ref(total, weight, bias, eps), total


@add_layer_norm.register_fake
def _(x, residual, weight, bias, eps):
    total = torch.empty_like(x + residual)
    return total.new_empty(total.shape, dtype=_affine_out_dtype(total, weight, bias)), total


for _name in ("rms_norm", "add_rms_norm", "softmax_rms_norm", "layer_norm", "add_layer_norm"):
    register(_name)
