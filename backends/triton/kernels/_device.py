"""``@triton.jit`` helpers more than one kernel calls (launch-side helpers are in _common)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, DOT_F32: tl.constexpr):
    """``a @ b`` accumulated in fp32; ieee so fp32 inputs never drop to tf32 (torch's default)."""
    if DOT_F32:
        # The triton 3.9 interpreter multiplies bf16 bit patterns as integers: upcast
        # (exact for bf16) so it computes what the GPU's bf16 MMA computes.
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def int8_to_float(x, dtype: tl.constexpr):
    """int8 ``x`` as exact floats of ``dtype`` with no int -> float convert instruction.

    A convert runs at an eighth of the FMA rate on sm_80/sm_90 (`graphopt kernels` counts
    them); one per element bounds a kernel that dequantizes a cache. Instead x + 128 (0..255)
    is added into the mantissa of a power of two with an ulp of 1 and that power subtracted
    back, exactly: 1024 for fp16 (bits 0x6400), 2^23 for fp32 (0x4B000000). bf16's 8 bits
    cannot hold 0..255 above a power of two, so bf16 goes through fp32 (a shift, not a convert).
    """
    if dtype == tl.float16:
        return (x.to(tl.int16) + 0x6480).to(tl.float16, bitcast=True) - 1152.0
    else:
        return ((x.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0).to(dtype)
