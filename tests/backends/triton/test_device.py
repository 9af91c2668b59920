"""The shared ``@triton.jit`` helpers (kernels/_device.py) under the interpreter."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from graphopt.backends.triton.kernels import _device


@triton.jit
def _int8_kernel(x_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, _device.int8_to_float(tl.load(x_ptr + i), out_ptr.dtype.element_ty))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_int8_becomes_the_same_float_without_a_convert(dtype):
    # Every int8 value: the bit trick (kernels/_device.py) must give exactly x.to(dtype).
    x = torch.arange(-128, 128, dtype=torch.int8)
    got = torch.empty(256, dtype=dtype)
    _int8_kernel[(1,)](x, got, N=256)
    assert torch.equal(got, x.to(dtype))
