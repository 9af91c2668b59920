"""fuse_rms_norm, Before/Expected: the whole graph the pass leaves, node for node
(tests/passes/_before_expected.py), for the spellings whose rewrite differs in shape:
casts absorbed, ``(1 + w)`` carried as weight_offset, and aten.rms_norm read in float32."""

import torch
from torch import nn

from tests.helpers import aten_graph
from tests.passes._before_expected import Expected, assert_pass_result

PASS = "fuse_rms_norm"
g, aten = torch.ops.graphopt, torch.ops.aten


class HfRmsNorm(nn.Module):
    """Llama / Hugging Face: upcast to float32, rsqrt, cast back, then the weight."""

    def __init__(self, hidden=8):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(hidden, dtype=torch.float16))

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


class GemmaDivSqrt(nn.Module):
    """``x / sqrt(mean(x * x) + eps) * (1 + w)``: the add of 1 to w dies with the match."""

    def __init__(self, hidden=8):
        super().__init__()
        self.weight = nn.Parameter(0.1 * torch.randn(hidden))

    def forward(self, x):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * (1.0 + self.weight)


def test_hf_spelling_is_one_op_on_the_half_tensor():
    module = HfRmsNorm()
    before = aten_graph(module, torch.randn(2, 8).half())
    b = Expected()
    x, w = b.input((2, 8), torch.float16), b.const("weight", module.weight)
    expected = b.output(b.new(g.rms_norm.default, x, w, 1e-6, 0.0, by=PASS))
    assert_pass_result(PASS, before, expected)


def test_gemma_div_sqrt_spelling_carries_the_weight_offset():
    module = GemmaDivSqrt()
    before = aten_graph(module, torch.randn(2, 8))
    b = Expected()
    x, w = b.input((2, 8)), b.const("weight", module.weight)
    expected = b.output(b.new(g.rms_norm.default, x, w, 1e-6, 1.0, by=PASS))
    assert_pass_result(PASS, before, expected)


def test_aten_rms_norm_of_a_half_tensor_is_read_in_float32():
    """nn.RMSNorm (kept whole by torch.export) scales by w in float32 before rounding: the op
    reads x and w upcast, and its default eps is float32's machine epsilon."""
    module = nn.RMSNorm(8).half()
    before = aten_graph(module, torch.randn(2, 8).half())
    b = Expected()
    x, w = b.input((2, 8), torch.float16), b.const("weight", module.weight)
    wide_x = b.new(aten._to_copy.default, x, dtype=torch.float32, by=PASS)
    wide_w = b.new(aten._to_copy.default, w, dtype=torch.float32, by=PASS)
    normed = b.new(g.rms_norm.default, wide_x, wide_w, torch.finfo(torch.float32).eps, 0.0, by=PASS)
    expected = b.output(b.new(aten._to_copy.default, normed, dtype=torch.float16, by=PASS))
    assert_pass_result(PASS, before, expected)
