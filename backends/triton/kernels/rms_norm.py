"""RMSNorm family: ``rms_norm``, ``add_rms_norm`` and ``softmax_rms_norm`` in one kernel.

One program normalises one row held whole in registers, so each element is read once
and written once (plus the residual sum for ``add_rms_norm``): the kernel is bound by
memory bandwidth, which is the point of fusing. Statistics are float32 whatever the
input; intermediate values are rounded where the reference op rounds them
(graphopt/ops/norms.py), so fp32 results match it to float32 precision.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import _common


@triton.jit
def rms_norm_kernel(
    x_ptr,            # *T [rows, n_cols] input, unit column stride
    res_ptr,          # *R [rows, n_cols] residual added to x first; read only if HAS_RESIDUAL
    w_ptr,            # *W [n_cols] weight; read only if HAS_WEIGHT
    out_ptr,          # *O [rows, n_cols] normalised output
    sum_ptr,          # *S [rows, n_cols] x + residual, the new residual stream; written only if HAS_RESIDUAL
    x_row_stride,     # i32 elements between rows of x
    res_row_stride,   # i32 elements between rows of the residual
    out_row_stride,   # i32 elements between rows of out
    sum_row_stride,   # i32 elements between rows of the sum
    n_cols,           # i32 row length; columns >= n_cols are masked off
    eps,              # fp32 added to mean(x^2) before the rsqrt
    weight_offset,    # fp32 added to the weight (Gemma stores w - 1 and scales by 1 + w)
    HAS_RESIDUAL: tl.constexpr,  # add_rms_norm: normalise x + residual and store the sum
    HAS_WEIGHT: tl.constexpr,    # False: no affine scale
    SOFTMAX: tl.constexpr,       # softmax_rms_norm: normalise softmax(x) instead of x
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
    if SOFTMAX:
        x = tl.where(mask, x, float("-inf"))
        # exp(x - max) as exp2(x * log2(e) - max * log2(e)): one FFMA before the exp2 where
        # x - max and the exp's own scaling by log2(e) take two instructions per element.
        LOG2E: tl.constexpr = 1.4426950408889634
        e = tl.exp2(x * LOG2E - tl.max(x, axis=0) * LOG2E)  # masked lanes give exp2(-inf) = 0
        # softmax is rounded to the input dtype before it is normalised, as in the reference.
        x = (e * (1.0 / tl.sum(e, axis=0))).to(norm_dtype).to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / n_cols  # masked lanes hold 0 and add nothing
    y = x * tl.rsqrt(mean_sq + eps)
    if HAS_WEIGHT:
        # The reference rounds the normalised row before the weight multiplies it; without a
        # weight the store's own rounding is that rounding, so no round trip is spent on it.
        y = y.to(norm_dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        # (w + offset) is rounded to the weight's dtype first, as the reference adds it there.
        y = y * (w + weight_offset).to(w_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


gpu_configs = _common.row_gpu_configs  # the knobs and why: _common.row_gpu_configs
prune_configs = _common.prune_row_configs
rms_norm_tuned = triton.autotune(
    configs=_common.pick_configs(gpu_configs, _common.ROW_INTERPRETER_CONFIG),
    key=["n_cols", "HAS_RESIDUAL", "HAS_WEIGHT", "SOFTMAX"],
    prune_configs_by={"early_config_prune": prune_configs},
)(rms_norm_kernel)


def _launch(x, residual, weight, eps, weight_offset, softmax, out, residual_out):
    n_cols = x.shape[-1]
    block = _common.check_row_fits(n_cols, 4, "rms_norm")  # fp32 registers whatever the input
    norm_in_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out_dtype = norm_in_dtype if weight is None else torch.promote_types(norm_in_dtype, weight.dtype)
    out = _common.output(out, x.shape, out_dtype, x.device)
    total = None
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
        total = _common.output(residual_out, x.shape, norm_in_dtype, x.device, "residual_out")
    if weight is not None and weight.shape != (n_cols,):
        raise ValueError(f"weight must be ({n_cols},), got {tuple(weight.shape)}")
    if x.numel() == 0:
        return out, total
    x2 = _common.rows_view(x, n_cols)
    r2 = _common.rows_view(residual, n_cols) if residual is not None else x2
    o2, s2 = out.view(-1, n_cols), (total.view(-1, n_cols) if total is not None else out.view(-1, n_cols))
    w = weight.contiguous() if weight is not None else x2  # a dummy pointer, never read
    rms_norm_tuned[(x2.shape[0],)](
        x2, r2, w, o2, s2, x2.stride(0), r2.stride(0), o2.stride(0), s2.stride(0),
        n_cols, float(eps), float(weight_offset),
        HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, SOFTMAX=softmax, BLOCK=block,
    )
    return out, total


def rms_norm(x: Tensor, weight: Tensor | None, eps: float, weight_offset: float = 0.0, *,
             out: Tensor | None = None) -> Tensor:
    """``graphopt.rms_norm`` over the last dim of ``x`` (any leading dims)."""
    return _launch(x, None, weight, eps, weight_offset, False, out, None)[0]


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, weight_offset: float = 0.0,
                 *, out: Tensor | None = None, residual_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``graphopt.add_rms_norm``: ``(rms_norm(x + residual), x + residual)``."""
    return _launch(x, residual, weight, eps, weight_offset, False, out, residual_out)


def softmax_rms_norm(x: Tensor, weight: Tensor | None, eps: float, weight_offset: float = 0.0, *,
                     out: Tensor | None = None) -> Tensor:
    """``graphopt.softmax_rms_norm``: ``rms_norm(softmax(x, -1))`` in one read of ``x``."""
    return _launch(x, None, weight, eps, weight_offset, True, out, None)[0]


def aot_specs(name: str, warp: int) -> list[dict]:
    """One fp16 instantiation of ``name`` at a Llama-sized hidden dim (4096) for a ``warp``-wide target."""
    flags = {"rms_norm": (False, False), "add_rms_norm": (True, False), "softmax_rms_norm": (False, True)}
    has_residual, softmax = flags[name]
    block = 4096 if not softmax else 1024  # softmax_rms_norm runs over score-sized rows
    signature = {"x_ptr": "*fp16", "res_ptr": "*fp16", "w_ptr": "*fp16", "out_ptr": "*fp16", "sum_ptr": "*fp16",
                 "x_row_stride": "i32", "res_row_stride": "i32", "out_row_stride": "i32", "sum_row_stride": "i32",
                 "n_cols": "i32", "eps": "fp32", "weight_offset": "fp32"}
    constexprs = {"HAS_RESIDUAL": has_residual, "HAS_WEIGHT": True, "SOFTMAX": softmax, "BLOCK": block}
    return [dict(fn=rms_norm_kernel, signature=signature, constexprs=constexprs,
                 num_warps=_common.row_warps(block, warp), num_stages=1,
                 divisible=("x_row_stride", "res_row_stride", "out_row_stride", "sum_row_stride", "n_cols"))]
