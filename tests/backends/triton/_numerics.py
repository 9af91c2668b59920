"""Tolerances and helpers for checking kernels against the graphopt reference ops."""

from __future__ import annotations

import torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# fp32: both sides compute in fp32 and differ only in summation order.
# fp16: kernels keep fp32 where the reference rounds per op: a couple of ulps (2^-10).
# bf16: the same, plus triton 3.9's interpreter truncates fp32 -> bf16 where a GPU
#       rounds to nearest, so each rounding can be a full ulp (2^-7) off.
TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=4e-3, atol=4e-3),
    torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
}


def poisoned(shape, dtype: torch.dtype) -> torch.Tensor:
    """An output buffer full of NaN: any element the kernel fails to write shows up."""
    return torch.full(shape, float("nan"), dtype=dtype)


def randn(*shape, dtype: torch.dtype, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    """Random non-zero data (a zero would hide a missing multiply)."""
    t = torch.randn(*shape) * scale + shift
    t = torch.where(t.abs() < 1e-3, torch.full_like(t, 1e-3), t)
    return t.to(dtype)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None,
                   equal_nan: bool = False) -> None:
    dtype = dtype or expected.dtype
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != reference {expected.dtype}"
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != reference {tuple(expected.shape)}"
    torch.testing.assert_close(actual.float(), expected.float(), equal_nan=equal_nan, **TOLERANCES[dtype])
