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
