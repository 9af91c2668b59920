"""fuse_rms_norm: the spellings it must fuse, the near misses it must leave, numerics."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from graphopt import ir

from tests.helpers import aten_graph, assert_matches_eager, compile_with_graphopt, count, eager, run_pass

PIPE = ["canonicalize", "fuse_rms_norm"]


class PowMean(nn.Module):
    """Llama / Hugging Face spelling, with the float32 upcast and the cast back."""

    def __init__(self, hidden=32, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(hidden))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class MulMeanOnePlusWeight(nn.Module):
    """Gemma spelling: x * x, and (1 + w) scaling."""

    def __init__(self, hidden=32):
        super().__init__()
        self.weight = nn.Parameter(0.1 * torch.randn(hidden))

    def forward(self, x):
        h = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6)
        return h * (1.0 + self.weight)


class NoWeight(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


# How the inverse square root of v = mean(x^2) + eps is written: each is a pattern of the pass.
RMS_SPELLINGS = {
    "rsqrt": lambda h, v: h * torch.rsqrt(v),
    "rsqrt_inverse_first": lambda h, v: torch.rsqrt(v) * h,
    "reciprocal_sqrt": lambda h, v: h * (1 / torch.sqrt(v)),
    "div_sqrt": lambda h, v: h / torch.sqrt(v),
    "pow": lambda h, v: h * v.pow(-0.5),
    "pow_operator": lambda h, v: v ** -0.5 * h,
}


class SpelledRmsNorm(nn.Module):
    """An RMSNorm written with one of RMS_SPELLINGS, with or without Hugging Face's float32
    upcast and cast back, the weight on either side of its multiply."""

    def __init__(self, spelling, hidden=32, upcast=True, weight_first=True, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(hidden))
        self.spelling, self.upcast, self.weight_first, self.eps = spelling, upcast, weight_first, eps

    def forward(self, x):
        h = x.to(torch.float32) if self.upcast else x
        h = RMS_SPELLINGS[self.spelling](h, h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = h.to(x.dtype) if self.upcast else h
        return self.weight * h if self.weight_first else h * self.weight


@pytest.mark.parametrize("weight_first", [True, False], ids=["w_first", "w_last"])
@pytest.mark.parametrize("upcast", [True, False], ids=["upcast", "no_cast"])
@pytest.mark.parametrize("spelling", RMS_SPELLINGS)
def test_fuses_each_inverse_root_spelling(spelling, upcast, weight_first):
    torch.manual_seed(0)
    module, x = SpelledRmsNorm(spelling, upcast=upcast, weight_first=weight_first), torch.randn(2, 5, 32)
    out, report = compile_with_graphopt(module, x, passes=PIPE)
    assert report.op_counts == {"graphopt.rms_norm": 1}, report.op_counts
    assert [m for m in report.near_misses if m.pass_name == "fuse_rms_norm" and not m.screened] == []
    assert_matches_eager(out, eager(module, x), rel=1e-6)


@pytest.mark.parametrize("spelling", ["div_sqrt", "pow"])
def test_fp16_inverse_root_spellings_read_the_half_tensor(spelling):
    torch.manual_seed(0)
    module = SpelledRmsNorm(spelling).half()
    x = torch.randn(3, 32).half()
    out, report = compile_with_graphopt(module, x, passes=PIPE)
    assert report.op_counts == {"graphopt.rms_norm": 1}, report.op_counts  # the casts went into the op
    assert out.dtype == torch.float16
    assert_matches_eager(out, eager(module, x), rel=2e-3)


@pytest.mark.parametrize("module", [PowMean(), MulMeanOnePlusWeight(), NoWeight()], ids=type)
def test_fuses_each_spelling_and_matches_eager(module):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 32)
    out, report = compile_with_graphopt(module, x, passes=PIPE)
    assert count(report, "graphopt.rms_norm") == 1
    assert count(report, "aten.rsqrt") == 0 and count(report, "aten.mean") == 0
    assert_matches_eager(out, eager(module, x), rel=1e-6)


def test_fp16_with_upcast_matches_eager():
    torch.manual_seed(0)
    module = PowMean().half()
    x = torch.randn(3, 32).half()
    out, report = compile_with_graphopt(module, x, passes=PIPE)
    assert count(report, "graphopt.rms_norm") == 1
    assert out.dtype == torch.float16
    assert_matches_eager(out, eager(module, x), rel=2e-3)


class RoundsThroughHalf(nn.Module):
    """fp32 -> fp16 -> fp32 -> norm -> fp16: the fp16 rounding before the norm is real math."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(32).half())

    def forward(self, y):
        h = y.half().float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.half()


def test_reads_the_narrow_tensor_but_keeps_an_earlier_rounding():
    torch.manual_seed(0)
    module, y = RoundsThroughHalf(), 10 * torch.randn(3, 32)
    out, report = compile_with_graphopt(module, y, passes=PIPE)
    assert count(report, "graphopt.rms_norm") == 1
    assert count(report, "aten._to_copy") == 1  # only the fp32 -> fp16 rounding stays
    assert_matches_eager(out, eager(module, y), rel=1e-3)


class OtherAxis(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6)


class EpsFromInput(nn.Module):
    def forward(self, x, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class VarianceReused(nn.Module):
    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + 1e-6), var


class ScalesAnotherTensor(nn.Module):
    def forward(self, x, y):
        return y * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class DivSqrtOtherAxis(nn.Module):
    def forward(self, x):
        return x / torch.sqrt(x.pow(2).mean(1, keepdim=True) + 1e-6)


class PowOfMeanWithoutEps(nn.Module):
    def forward(self, x):
        return x * x.pow(2).mean(-1, keepdim=True).pow(-0.5)


class SqrtDividedByX(nn.Module):
    def forward(self, x):
        return torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) / x


class SqrtTimesX(nn.Module):
    def forward(self, x):
        return x * torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class ReciprocalSqrtOfAnother(nn.Module):
    def forward(self, x, y):
        return y * (1 / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class PowWrongExponent(nn.Module):
    def forward(self, x):
        return x * (x.pow(2).mean(-1, keepdim=True) + 1e-6).pow(-0.25)


@pytest.mark.parametrize(
    "module, inputs, reason",
    [
        (OtherAxis(), (torch.randn(2, 4, 8),), "mean over dim 1, expected -1"),
        (EpsFromInput(), (torch.randn(2, 8), torch.full((2, 1), 1e-6)), "eps is not a constant"),
        (VarianceReused(), (torch.randn(2, 8),), "variance mean has 2 users; a fusion would lose the others"),
        (ScalesAnotherTensor(), (torch.randn(2, 8), torch.randn(2, 8)),
         "the inverse root scales a different tensor than the one squared"),
        (DivSqrtOtherAxis(), (torch.randn(2, 4, 8),), "mean over dim 1, expected -1"),
        (PowOfMeanWithoutEps(), (torch.randn(2, 8),), "pow input: expected aten.add, found aten.mean"),
        (SqrtDividedByX(), (torch.randn(2, 8),), "divides sqrt(v) by a tensor, not a tensor by sqrt(v)"),
        (SqrtTimesX(), (torch.randn(2, 8),), "sqrt user: expected x / sqrt(v) or 1 / sqrt(v), found aten.mul"),
        (ReciprocalSqrtOfAnother(), (torch.randn(2, 8), torch.randn(2, 8)),
         "the inverse root scales a different tensor than the one squared"),
    ],
    ids=["other_axis", "eps_not_constant", "second_user", "other_tensor", "div_sqrt_other_axis", "pow_no_eps",
         "sqrt_divided", "sqrt_times_x", "reciprocal_other_tensor"],
)
def test_skips_when_math_differs(module, inputs, reason):
    out, report = compile_with_graphopt(module, *inputs, passes=PIPE)
    assert count(report, "graphopt.rms_norm") == 0
    reasons = [m.reason for m in report.near_misses if m.pass_name == "fuse_rms_norm" and not m.screened]
    assert reasons == [reason]
    assert_matches_eager(out, eager(module, *inputs), rel=1e-6)


def test_powers_other_than_minus_half_are_screened_with_their_reason():
    """Every pow is an anchor (x.pow(2) too): --why says why it is no candidate, grouped."""
    gm = aten_graph(PowWrongExponent(), torch.randn(2, 8))
    result = run_pass("fuse_rms_norm", gm)
    assert result.stats["matches"] == 0
    assert [(m.reason, m.screened) for m in result.near_misses] == [
        ("pow(x, 2) is no inverse square root (only pow(v, -0.5) is)", True),
        ("pow(x, -0.25) is no inverse square root (only pow(v, -0.5) is)", True)]


# -- aten.rms_norm (nn.RMSNorm, F.rms_norm), which torch.export keeps whole --------------------


@pytest.mark.parametrize("dtype, rel", [(torch.float32, 1e-6), (torch.float16, 1e-3)], ids=["fp32", "fp16"])
@pytest.mark.parametrize("eps", [1e-6, None], ids=["eps", "default_eps"])
def test_export_graph_aten_rms_norm_fuses(eps, dtype, rel):
    torch.manual_seed(0)
    module = nn.RMSNorm(32, eps=eps).to(dtype)
    nn.init.normal_(module.weight, 1.0, 0.1)
    x = torch.randn(2, 5, 32).to(dtype)
    gm = aten_graph(module, x)
    assert run_pass("fuse_rms_norm", gm).stats["matches"] == 1
    counts = ir.op_counts(gm)
    assert counts.get("graphopt.rms_norm") == 1 and "aten.rms_norm" not in counts
    out = gm(x)[0]
    assert out.dtype == dtype
    assert_matches_eager(out, eager(module, x), rel=rel)  # fp16: the op scales by w in fp32, as aten does


class RmsNormOverTwoDims(nn.Module):
    def forward(self, x):
        return F.rms_norm(x, [4, 8], eps=1e-6)


def test_skips_aten_rms_norm_over_more_than_the_last_dim():
    gm = aten_graph(RmsNormOverTwoDims(), torch.randn(2, 4, 8))
    result = run_pass("fuse_rms_norm", gm)
    assert result.stats["matches"] == 0
    assert [m.reason for m in result.near_misses] == ["normalized over [4, 8] of [2, 4, 8], expected the last dim"]
