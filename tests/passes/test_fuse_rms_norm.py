"""fuse_rms_norm: the spellings it must fuse, the near misses it must leave, numerics."""

import pytest
import torch
from torch import nn

from tests.helpers import assert_matches_eager, compile_with_graphopt, count, eager

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


@pytest.mark.parametrize(
    "module, inputs, reason",
    [
        (OtherAxis(), (torch.randn(2, 4, 8),), "mean over dim 1, expected -1"),
        (EpsFromInput(), (torch.randn(2, 8), torch.full((2, 1), 1e-6)), "eps is not a constant"),
        (VarianceReused(), (torch.randn(2, 8),), "mean"),
        (ScalesAnotherTensor(), (torch.randn(2, 8), torch.randn(2, 8)), "different tensor"),
    ],
    ids=["other_axis", "eps_not_constant", "second_user", "other_tensor"],
)
def test_skips_when_math_differs(module, inputs, reason):
    out, report = compile_with_graphopt(module, *inputs, passes=PIPE)
    assert count(report, "graphopt.rms_norm") == 0
    reasons = [m.reason for m in report.near_misses if m.pass_name == "fuse_rms_norm"]
    assert any(reason in r for r in reasons), reasons
    assert_matches_eager(out, eager(module, *inputs), rel=1e-6)
