"""Rotary embedding kernel vs the graphopt reference op, under the interpreter."""

from __future__ import annotations

import pytest
import torch

import graphopt.ops  # noqa: F401  (registers torch.ops.graphopt.*)
from graphopt.backends.triton.kernels import rope as rp

from ._numerics import DTYPES, assert_matches, poisoned, randn

# (B, H, S, D, R): full rotary; partial rotary with D = 24 (not a power of two) and
# H = 6 (a partial head block: the interpreter's is 4); partial rotary at D = 64.
SHAPES = [(2, 3, 5, 16, 16), (1, 6, 7, 24, 12), (2, 5, 3, 64, 32)]
ops = torch.ops.graphopt


def _tables(batch, seq, rot, dtype):
    return randn(batch, seq, rot, dtype=dtype), randn(batch, seq, rot, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope(shape, dtype, interleaved):
    b, h, s, d, r = shape
    x = randn(b, h, s, d, dtype=dtype)
    cos, sin = _tables(b, s, r, dtype)
    out = poisoned(x.shape, dtype)
    got = rp.rope(x, cos, sin, interleaved, out=out)
    assert got is out
    assert_matches(got, ops.rope(x, cos, sin, interleaved))


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_one_table_for_the_batch(interleaved):
    x = randn(3, 4, 5, 32, dtype=torch.float32)
    cos, sin = _tables(1, 5, 32, torch.float32)
    ref = ops.rope(x, cos.expand(3, -1, -1), sin.expand(3, -1, -1), interleaved)
    assert_matches(rp.rope(x, cos, sin, interleaved), ref)


def test_rope_reads_a_transposed_projection_in_place():
    # q from a [B, S, H, D] projection viewed as [B, H, S, D]: strided, not copied.
    q = randn(2, 5, 4, 32, dtype=torch.float32).transpose(1, 2)
    cos, sin = _tables(2, 5, 16, torch.float32)
    assert_matches(rp.rope(q, cos, sin), ops.rope(q, cos, sin))


def test_rope_passes_channels_past_the_rotary_dim_through():
    x = randn(1, 2, 3, 24, dtype=torch.float32)
    cos, sin = _tables(1, 3, 8, torch.float32)
    torch.testing.assert_close(rp.rope(x, cos, sin)[..., 8:], x[..., 8:], rtol=0, atol=0)


def test_tolerance_catches_the_wrong_pairing():
    x = randn(1, 2, 3, 16, dtype=torch.float32)
    cos, sin = _tables(1, 3, 16, torch.float32)
    with pytest.raises(AssertionError):
        assert_matches(rp.rope(x, cos, sin, interleaved=True), ops.rope(x, cos, sin, False))


def test_rejects_odd_or_oversized_rotary_dims():
    x = torch.ones(1, 1, 2, 8)
    with pytest.raises(ValueError, match="even"):
        rp.rope(x, torch.ones(1, 2, 3), torch.ones(1, 2, 3))
    with pytest.raises(ValueError, match="<= head dim"):
        rp.rope(x, torch.ones(1, 2, 10), torch.ones(1, 2, 10))
