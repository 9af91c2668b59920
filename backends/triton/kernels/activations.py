"""Activations: gated MLPs (``swiglu``, ``geglu``) and ``bias_gelu``.

The gated ops read the merged gate/up GEMM output ``[..., 2n]`` once and write
``[..., n]``; bias_gelu folds the bias add into the GELU. All are elementwise, so a
2-D grid of (row, column block) keeps indexing free of per-element division and
every access contiguous. Math is float32 with one rounding at the store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import _common

ACT_SILU, ACT_GELU_ERF, ACT_GELU_TANH = 0, 1, 2
_GELU_MODES = {"none": ACT_GELU_ERF, "tanh": ACT_GELU_TANH}


@triton.jit
def _activate(x, ACT: tl.constexpr):
    """``x`` (float32) through SiLU or GELU (erf, or the tanh approximation)."""
    if ACT == 0:
        return x / (1.0 + tl.exp(-x))
    elif ACT == 1:
        return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    else:
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)  # sqrt(2/pi) * (x + 0.044715 x^3)
        # tanh(u) = 1 - 2 / (exp(2u) + 1): no libdevice tanh, so it builds for both vendors
        # and the interpreter; saturates to +-1 instead of overflowing to nan.
        return 0.5 * x * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))


@triton.jit
def gated_kernel(
    gu_ptr,          # *T [rows, 2 * n] merged gate/up projection: gate = [:, :n], up = [:, n:]
    out_ptr,         # *O [rows, n] act(gate) * up
    gu_row_stride,   # i32 elements between rows of gate_up
    out_row_stride,  # i32 elements between rows of out
    n,               # i32 output width (half of gate_up's last dim)
    ACT: tl.constexpr,    # ACT_SILU (swiglu), ACT_GELU_ERF or ACT_GELU_TANH (geglu)
    BLOCK: tl.constexpr,  # columns per program (power of two); the tail block is masked
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(gu_ptr + row * gu_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * gu_row_stride + n + cols, mask=mask, other=0.0).to(tl.float32)
    out = _activate(gate, ACT) * up
    tl.store(out_ptr + row * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def bias_gelu_kernel(
    x_ptr,           # *T [rows, n] input
    b_ptr,           # *B [n] bias added before the GELU; read only if HAS_BIAS
    out_ptr,         # *O [rows, n] gelu(x + bias)
    x_row_stride,    # i32 elements between rows of x
    out_row_stride,  # i32 elements between rows of out
    n,               # i32 row length
    HAS_BIAS: tl.constexpr,  # False: plain GELU
    ACT: tl.constexpr,       # ACT_GELU_ERF or ACT_GELU_TANH
    BLOCK: tl.constexpr,     # columns per program (power of two); the tail block is masked
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        # The reference adds in the promoted dtype: round the sum as it does.
        x = (x + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)).to(out_ptr.dtype.element_ty)
        x = x.to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, _activate(x, ACT).to(out_ptr.dtype.element_ty), mask=mask)


def gpu_configs(hip: bool) -> list[triton.Config]:
    """Column-block sizes x warps: 1024-4096 elements per program saturates HBM on both vendors.

    Each keeps >= 8 elements per thread (one 128-bit fp16 load); num_stages=1 and no MI300
    knobs: see _common (no loop to pipeline, no tl.dot, <= 128 VGPRs).
    """
    warp = 64 if hip else 32
    # Same threads per program on both vendors: a 64-wide wavefront needs half the warps.
    return [triton.Config({"BLOCK": block}, num_warps=threads // warp, num_stages=1)
            for block in (1024, 2048, 4096) for threads in (128, 256)
            if block // threads >= _common.MIN_ELEMENTS_PER_THREAD]


_configs = _common.pick_configs(gpu_configs, triton.Config({"BLOCK": 128}, num_warps=1, num_stages=1))
gated_tuned = triton.autotune(configs=_configs, key=["n", "ACT"])(gated_kernel)
bias_gelu_tuned = triton.autotune(configs=_configs, key=["n", "ACT", "HAS_BIAS"])(bias_gelu_kernel)


def _grid(rows, n):
    return lambda meta: (rows, triton.cdiv(n, meta["BLOCK"]))


def _gated(gate_up: Tensor, act: int, out: Tensor | None) -> Tensor:
    width = gate_up.shape[-1]
    if width % 2:
        raise ValueError(f"gated activation needs an even last dim, got {width}")
    n = width // 2
    out = _common.output(out, (*gate_up.shape[:-1], n), gate_up.dtype, gate_up.device)
    if out.numel() == 0:
        return out
    gu = _common.rows_view(gate_up, width)
    o2 = out.view(-1, n)
    gated_tuned[_grid(gu.shape[0], n)](gu, o2, gu.stride(0), o2.stride(0), n, ACT=act)
    return out


def _gelu_mode(approximate: str) -> int:
    if approximate not in _GELU_MODES:
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    return _GELU_MODES[approximate]


def swiglu(gate_up: Tensor, *, out: Tensor | None = None) -> Tensor:
    """``graphopt.swiglu``: ``silu(gate_up[..., :n]) * gate_up[..., n:]``."""
    return _gated(gate_up, ACT_SILU, out)


def geglu(gate_up: Tensor, approximate: str = "none", *, out: Tensor | None = None) -> Tensor:
    """``graphopt.geglu``: ``gelu(gate_up[..., :n], approximate) * gate_up[..., n:]``."""
    return _gated(gate_up, _gelu_mode(approximate), out)


def bias_gelu(x: Tensor, bias: Tensor | None, approximate: str = "none", *, out: Tensor | None = None) -> Tensor:
    """``graphopt.bias_gelu``: ``gelu(x + bias, approximate)`` with the bias over the last dim."""
    act = _gelu_mode(approximate)
    n = x.shape[-1]
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be ({n},), got {tuple(bias.shape)}")
    dtype = x.dtype if bias is None else torch.promote_types(x.dtype, bias.dtype)
    out = _common.output(out, x.shape, dtype, x.device)
    if out.numel() == 0:
        return out
    x2 = _common.rows_view(x, n)
    o2 = out.view(-1, n)
    b = bias.contiguous() if bias is not None else x2  # a dummy pointer, never read
    bias_gelu_tuned[_grid(x2.shape[0], n)](x2, b, o2, x2.stride(0), o2.stride(0), n,
                                           HAS_BIAS=bias is not None, ACT=act)
    return out


def aot_specs(name: str, warp: int) -> list[dict]:
    """fp16 instantiations: swiglu, geglu (erf) and bias_gelu (tanh), 2048-column blocks, 256 threads."""
    # Row strides and n are multiples of 16 for every real MLP width (e.g. 14336).
    options = dict(num_warps=256 // warp, num_stages=1)
    if name in ("swiglu", "geglu"):
        signature = {"gu_ptr": "*fp16", "out_ptr": "*fp16", "gu_row_stride": "i32", "out_row_stride": "i32",
                     "n": "i32"}
        act = ACT_SILU if name == "swiglu" else ACT_GELU_ERF
        return [dict(fn=gated_kernel, signature=signature, constexprs={"ACT": act, "BLOCK": 2048},
                     **{**options, "divisible": ("gu_row_stride", "out_row_stride", "n")})]
    signature = {"x_ptr": "*fp16", "b_ptr": "*fp16", "out_ptr": "*fp16", "x_row_stride": "i32",
                 "out_row_stride": "i32", "n": "i32"}
    constexprs = {"HAS_BIAS": True, "ACT": ACT_GELU_TANH, "BLOCK": 2048}
    return [dict(fn=bias_gelu_kernel, signature=signature, constexprs=constexprs,
                 **{**options, "divisible": ("x_row_stride", "out_row_stride", "n")})]
