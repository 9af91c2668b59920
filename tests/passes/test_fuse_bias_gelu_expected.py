"""fuse_bias_gelu, Before/Expected: the whole graph the pass leaves, node for node
(tests/passes/_before_expected.py): an explicit bias add, and a Linear's bias moved out of
its GEMM into the activation."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import aten_graph
from tests.passes._before_expected import Expected, assert_pass_result

PASS = "fuse_bias_gelu"
g, aten = torch.ops.graphopt, torch.ops.aten


class BiasAddGelu(nn.Module):
    def __init__(self, hidden=8):
        super().__init__()
        self.b = nn.Parameter(0.1 * torch.randn(hidden))

    def forward(self, x):
        return F.gelu(x + self.b)


class LinearNewGelu(nn.Module):
    """GPT-2's gelu_new written by hand after a Linear with a bias."""

    def __init__(self, hidden=8, inter=16):
        super().__init__()
        self.fc = nn.Linear(hidden, inter)

    def forward(self, x):
        h = self.fc(x)
        return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))


def test_bias_add_and_gelu_become_one_op():
    module = BiasAddGelu()
    before = aten_graph(module, torch.randn(2, 8))
    b = Expected()
    x, bias = b.input((2, 8)), b.const("b", module.b)
    assert_pass_result(PASS, before, b.output(b.new(g.bias_gelu.default, x, bias, "none", by=PASS)))


def test_a_linear_bias_moves_into_the_hand_written_tanh_gelu():
    module = LinearNewGelu()
    before = aten_graph(module, torch.randn(2, 8))
    b = Expected()
    x, w, bias = b.input((2, 8)), b.const("fc.weight", module.fc.weight), b.const("fc.bias", module.fc.bias)
    gemm = b.new(aten.linear.default, x, w, by=PASS)
    assert_pass_result(PASS, before, b.output(b.new(g.bias_gelu.default, gemm, bias, "tanh", by=PASS)))
