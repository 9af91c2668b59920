"""SwiGLU / GeGLU / bias-GELU kernels vs the graphopt reference ops, under the interpreter."""

from __future__ import annotations

import pytest
import torch

import graphopt.ops  # noqa: F401  (registers torch.ops.graphopt.*)
from graphopt.backends.triton.kernels import activations as act

from ._numerics import DTYPES, assert_matches, poisoned, randn

# Output widths 8, 96 and 300: a single partial block, and a masked tail after full ones
# (the interpreter's column block is 128).
SHAPES = [(1, 16), (3, 5, 192), (4, 600)]
ops = torch.ops.graphopt
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_swiglu(shape, dtype):
    gate_up = randn(*shape, dtype=dtype, scale=3.0)
    out = poisoned((*shape[:-1], shape[-1] // 2), dtype)
    got = act.swiglu(gate_up, out=out)
    assert got is out
    assert_matches(got, ops.swiglu(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_geglu(shape, dtype, approximate):
    gate_up = randn(*shape, dtype=dtype, scale=3.0)
    out = poisoned((*shape[:-1], shape[-1] // 2), dtype)
    assert_matches(act.geglu(gate_up, approximate, out=out), ops.geglu(gate_up, approximate))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_gelu(shape, dtype, approximate, with_bias):
    x = randn(*shape, dtype=dtype, scale=3.0)
    bias = randn(shape[-1], dtype=dtype) if with_bias else None
    out = poisoned(shape, dtype)
    assert_matches(act.bias_gelu(x, bias, approximate, out=out), ops.bias_gelu(x, bias, approximate))


def test_gelu_tanh_saturates_without_nan():
    # exp(2u) overflows to inf for large |x|; the tanh formula must still give gelu(x).
    x = torch.tensor([[-200.0, -30.0, 30.0, 200.0]])
    assert_matches(act.bias_gelu(x, None, "tanh"), ops.bias_gelu(x, None, "tanh"))


def test_bias_promotes_the_output_dtype():
    x, bias = randn(2, 24, dtype=torch.float16), randn(24, dtype=torch.float32)
    assert_matches(act.bias_gelu(x, bias), ops.bias_gelu(x, bias), dtype=torch.float16)


def test_tolerance_catches_erf_for_tanh():
    x = randn(4, 64, dtype=torch.float32, scale=2.0)
    with pytest.raises(AssertionError):
        assert_matches(act.geglu(x, "tanh"), ops.geglu(x, "none"))


def test_rejects_odd_width_and_unknown_approximation():
    with pytest.raises(ValueError, match="even"):
        act.swiglu(torch.ones(2, 7))
    with pytest.raises(ValueError, match="approximate"):
        act.bias_gelu(torch.ones(2, 8), None, "erf")
