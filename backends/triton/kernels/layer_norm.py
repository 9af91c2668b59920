"""LayerNorm family: ``layer_norm`` and ``add_layer_norm`` (ORT's SkipLayerNormalization).

One program normalises one row held whole in registers. Mean and variance are float32
and two-pass over the registers (no E[x^2] - E[x]^2 cancellation). The normalised
value is rounded to the input dtype as the reference does; the affine part is then
done in float32 with one final rounding, within one ulp of the reference's per-op
rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import _common


@triton.jit
def layer_norm_kernel(
    x_ptr,            # *T [rows, n_cols] input, unit column stride
    res_ptr,          # *R [rows, n_cols] residual added to x first; read only if HAS_RESIDUAL
    w_ptr,            # *W [n_cols] scale; read only if HAS_WEIGHT
    b_ptr,            # *B [n_cols] shift; read only if HAS_BIAS
    out_ptr,          # *O [rows, n_cols] normalised output
    sum_ptr,          # *S [rows, n_cols] x + residual; written only if HAS_RESIDUAL
    x_row_stride,     # i32 elements between rows of x
    res_row_stride,   # i32 elements between rows of the residual
    out_row_stride,   # i32 elements between rows of out
    sum_row_stride,   # i32 elements between rows of the sum
    n_cols,           # i32 row length; columns >= n_cols are masked off
    eps,              # fp32 added to the variance before the rsqrt
    HAS_RESIDUAL: tl.constexpr,  # add_layer_norm: normalise x + residual and store the sum
    HAS_WEIGHT: tl.constexpr,    # False: no scale
    HAS_BIAS: tl.constexpr,      # False: no shift
    BLOCK: tl.constexpr,         # power of two >= n_cols: the whole row lives in registers
):
    row = tl.program_id(0).to(tl.int64)  # rows * stride can pass 2**31 on large batches
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        # The reference adds in the promoted dtype: round the sum before it is reused.
        total = (x + r).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * sum_row_stride + cols, total, mask=mask)
        x = total.to(tl.float32)
        norm_dtype = sum_ptr.dtype.element_ty
    else:
        norm_dtype = x_ptr.dtype.element_ty
    mean = tl.sum(x, axis=0) / n_cols
    centred = tl.where(mask, x - mean, 0.0)  # masked lanes must not add (0 - mean)^2
    var = tl.sum(centred * centred, axis=0) / n_cols  # biased, as F.layer_norm
    y = (centred * tl.rsqrt(var + eps)).to(norm_dtype).to(tl.float32)
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


gpu_configs = _common.row_gpu_configs  # the knobs and why: _common.row_gpu_configs
prune_configs = _common.prune_row_configs
layer_norm_tuned = triton.autotune(
    configs=_common.pick_configs(gpu_configs, _common.ROW_INTERPRETER_CONFIG),
    key=["n_cols", "HAS_RESIDUAL", "HAS_WEIGHT", "HAS_BIAS"],
    prune_configs_by={"early_config_prune": prune_configs},
)(layer_norm_kernel)


def _launch(x, residual, weight, bias, eps, out, residual_out):
    n_cols = x.shape[-1]
    block = _common.check_row_fits(n_cols, 4, "layer_norm")  # fp32 registers whatever the input
    norm_in_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out_dtype = norm_in_dtype
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            if t.shape != (n_cols,):
                raise ValueError(f"{name} must be ({n_cols},), got {tuple(t.shape)}")
            out_dtype = torch.promote_types(out_dtype, t.dtype)
    out = _common.output(out, x.shape, out_dtype, x.device)
    total = None
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
        total = _common.output(residual_out, x.shape, norm_in_dtype, x.device, "residual_out")
    if x.numel() == 0:
        return out, total
    x2 = _common.rows_view(x, n_cols)
    r2 = _common.rows_view(residual, n_cols) if residual is not None else x2
    o2 = out.view(-1, n_cols)
    s2 = total.view(-1, n_cols) if total is not None else o2
    w = weight.contiguous() if weight is not None else x2  # dummy pointers are never read
    b = bias.contiguous() if bias is not None else x2
    layer_norm_tuned[(x2.shape[0],)](
        x2, r2, w, b, o2, s2, x2.stride(0), r2.stride(0), o2.stride(0), s2.stride(0), n_cols, float(eps),
        HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, BLOCK=block,
    )
    return out, total


def layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, *,
               out: Tensor | None = None) -> Tensor:
    """``graphopt.layer_norm`` over the last dim of ``x`` (any leading dims)."""
    return _launch(x, None, weight, bias, eps, out, None)[0]


def add_layer_norm(x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, *,
                   out: Tensor | None = None, residual_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``graphopt.add_layer_norm``: ``(layer_norm(x + residual), x + residual)``."""
    return _launch(x, residual, weight, bias, eps, out, residual_out)


def aot_specs(name: str, warp: int) -> list[dict]:
    """One fp16 instantiation with weight and bias at a hidden dim of 4096 for a ``warp``-wide target."""
    block = 4096
    signature = {"x_ptr": "*fp16", "res_ptr": "*fp16", "w_ptr": "*fp16", "b_ptr": "*fp16", "out_ptr": "*fp16",
                 "sum_ptr": "*fp16", "x_row_stride": "i32", "res_row_stride": "i32", "out_row_stride": "i32",
                 "sum_row_stride": "i32", "n_cols": "i32", "eps": "fp32"}
    constexprs = {"HAS_RESIDUAL": name == "add_layer_norm", "HAS_WEIGHT": True, "HAS_BIAS": True, "BLOCK": block}
    return [dict(fn=layer_norm_kernel, signature=signature, constexprs=constexprs,
                 num_warps=_common.row_warps(block, warp), num_stages=1,
                 divisible=("x_row_stride", "res_row_stride", "out_row_stride", "sum_row_stride", "n_cols"))]
