"""RMSNorm / LayerNorm kernels vs the graphopt reference ops, under the interpreter."""

from __future__ import annotations

import pytest
import torch

import graphopt.ops  # noqa: F401  (registers torch.ops.graphopt.*)
from graphopt.backends.triton.kernels import layer_norm as ln
from graphopt.backends.triton.kernels import rms_norm as rn

from ._numerics import DTYPES, assert_matches, poisoned, randn

# Leading dims of every rank, rows of 1, 96 (not a power of two) and 1000 (masked tail).
SHAPES = [(1, 16), (3, 5, 96), (7, 1000)]
ops = torch.ops.graphopt


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
def test_rms_norm(shape, dtype, weight_offset):
    x, w = randn(*shape, dtype=dtype, scale=2.0), randn(shape[-1], dtype=dtype)
    out = poisoned(shape, dtype)
    got = rn.rms_norm(x, w, 1e-6, weight_offset, out=out)
    assert got is out
    assert_matches(got, ops.rms_norm(x, w, 1e-6, weight_offset))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_without_weight(dtype):
    x = randn(4, 72, dtype=dtype)
    assert_matches(rn.rms_norm(x, None, 1e-5, out=poisoned(x.shape, dtype)), ops.rms_norm(x, None, 1e-5))


def test_rms_norm_promotes_to_the_weight_dtype():
    x, w = randn(3, 40, dtype=torch.float16), randn(40, dtype=torch.float32)
    assert_matches(rn.rms_norm(x, w, 1e-6), ops.rms_norm(x, w, 1e-6), dtype=torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_add_rms_norm(shape, dtype):
    x, r, w = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype), randn(shape[-1], dtype=dtype)
    out, total = poisoned(shape, dtype), poisoned(shape, dtype)
    got, got_sum = rn.add_rms_norm(x, r, w, 1e-6, 1.0, out=out, residual_out=total)
    ref, ref_sum = ops.add_rms_norm(x, r, w, 1e-6, 1.0)
    assert got is out and got_sum is total
    assert_matches(got, ref)
    assert_matches(got_sum, ref_sum)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("weighted", [True, False])
def test_softmax_rms_norm(shape, dtype, weighted):
    # Without a weight the kernel rounds the normalised row once, in its store.
    x, w = randn(*shape, dtype=dtype, scale=3.0), randn(shape[-1], dtype=dtype) if weighted else None
    out = poisoned(shape, dtype)
    assert_matches(rn.softmax_rms_norm(x, w, 1e-6, out=out), ops.softmax_rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("affine", ["weight_bias", "weight", "none"])
def test_layer_norm(shape, dtype, affine):
    # A large mean tests the two-pass variance (E[x^2] - E[x]^2 would cancel).
    x = randn(*shape, dtype=dtype, scale=2.0, shift=8.0)
    w = randn(shape[-1], dtype=dtype) if affine != "none" else None
    b = randn(shape[-1], dtype=dtype) if affine == "weight_bias" else None
    out = poisoned(shape, dtype)
    assert_matches(ln.layer_norm(x, w, b, 1e-5, out=out), ops.layer_norm(x, w, b, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_add_layer_norm(shape, dtype):
    x, r = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype)
    w, b = randn(shape[-1], dtype=dtype), randn(shape[-1], dtype=dtype)
    out, total = poisoned(shape, dtype), poisoned(shape, dtype)
    got, got_sum = ln.add_layer_norm(x, r, w, b, 1e-5, out=out, residual_out=total)
    ref, ref_sum = ops.add_layer_norm(x, r, w, b, 1e-5)
    assert_matches(got, ref)
    assert_matches(got_sum, ref_sum)


def test_strided_rows_are_read_in_place():
    # Every other row of a wider buffer: a row stride of 2 * n_cols, no copy needed.
    base = randn(6, 2, 48, dtype=torch.float32)
    x = base[:, 0]
    w = randn(48, dtype=torch.float32)
    assert_matches(rn.rms_norm(x, w, 1e-6), ops.rms_norm(x, w, 1e-6))
    assert_matches(ln.layer_norm(x, w, w, 1e-5), ops.layer_norm(x, w, w, 1e-5))


def test_tolerance_catches_a_wrong_offset():
    # The fp32 tolerance must be tight enough to see a forgotten weight offset.
    x, w = randn(4, 64, dtype=torch.float32), randn(64, dtype=torch.float32)
    with pytest.raises(AssertionError):
        assert_matches(rn.rms_norm(x, w, 1e-6, 0.0), ops.rms_norm(x, w, 1e-6, 1.0))


def test_rejects_rows_too_long_for_one_block():
    with pytest.raises(ValueError, match="does not fit"):
        rn.rms_norm(torch.ones(1, 16385), None, 1e-6)


def test_rejects_a_badly_shaped_out():
    with pytest.raises(ValueError, match="out must be"):
        rn.rms_norm(torch.ones(2, 8), None, 1e-6, out=torch.empty(2, 9))
