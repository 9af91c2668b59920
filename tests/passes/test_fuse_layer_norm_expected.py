"""fuse_layer_norm, Before/Expected: the whole graph the pass leaves, node for node
(tests/passes/_before_expected.py): the native op, the decomposed form, and a residual add
folded in (the sum read through the op's second output)."""

import operator

import torch
from torch import nn

from tests.helpers import aten_graph
from tests.passes._before_expected import Expected, assert_pass_result

PASS = "fuse_layer_norm"
g = torch.ops.graphopt


class Decomposed(nn.Module):
    """``(x - mean) / sqrt(var + eps) * w + b`` with a biased variance."""

    def __init__(self, hidden=8):
        super().__init__()
        self.w = nn.Parameter(1 + 0.1 * torch.randn(hidden))
        self.b = nn.Parameter(0.1 * torch.randn(hidden))

    def forward(self, x):
        mean, var = x.mean(-1, keepdim=True), x.var(-1, keepdim=True, correction=0)
        return (x - mean) / torch.sqrt(var + 1e-5) * self.w + self.b


class ResidualLayerNorm(nn.Module):
    def __init__(self, hidden=8):
        super().__init__()
        self.ln = nn.LayerNorm(hidden)

    def forward(self, a, b):
        s = a + b
        return self.ln(s), s


def test_native_layer_norm_becomes_the_op():
    module = nn.LayerNorm(8)
    before = aten_graph(module, torch.randn(2, 8))
    b = Expected()
    x, w, bias = b.input((2, 8)), b.const("weight", module.weight), b.const("bias", module.bias)
    assert_pass_result(PASS, before, b.output(b.new(g.layer_norm.default, x, w, bias, 1e-5, by=PASS)))


def test_decomposed_form_becomes_the_op():
    module = Decomposed()
    before = aten_graph(module, torch.randn(2, 8))
    b = Expected()
    x, w, bias = b.input((2, 8)), b.const("w", module.w), b.const("b", module.b)
    assert_pass_result(PASS, before, b.output(b.new(g.layer_norm.default, x, w, bias, 1e-5, by=PASS)))


def test_residual_add_folds_in_and_the_sum_is_the_second_output():
    module = ResidualLayerNorm()
    before = aten_graph(module, torch.randn(2, 8), torch.randn(2, 8))
    b = Expected()
    a, r = b.input((2, 8)), b.input((2, 8))
    w, bias = b.const("ln.weight", module.ln.weight), b.const("ln.bias", module.ln.bias)
    fused = b.new(g.add_layer_norm.default, a, r, w, bias, 1e-5, by=PASS)
    expected = b.output(b.new(operator.getitem, fused, 0, by=PASS), b.new(operator.getitem, fused, 1, by=PASS))
    assert_pass_result(PASS, before, expected)
