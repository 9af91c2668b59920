"""fuse_add_rms_norm, Before/Expected: the whole graph the pass leaves, node for node
(tests/passes/_before_expected.py): the sum and the norm become one op, and the residual
stream reads its second output."""

import operator

import torch
from torch import nn

from tests.helpers import aten_graph
from tests.passes._before_expected import Expected, assert_pass_result

PASS = "fuse_add_rms_norm"
g = torch.ops.graphopt


class AddThenNorm(nn.Module):
    """``s = a + b``; returns (rms_norm(s), s): a pre-norm block's residual add."""

    def __init__(self, hidden=8):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(hidden))

    def forward(self, a, b):
        s = a + b
        return g.rms_norm(s, self.weight, 1e-6, 0.0), s


def test_sum_and_norm_become_one_op_with_the_sum_as_its_second_output():
    module = AddThenNorm()
    before = aten_graph(module, torch.randn(2, 8), torch.randn(2, 8))
    b = Expected()
    a, r, w = b.input((2, 8)), b.input((2, 8)), b.const("weight", module.weight)
    fused = b.new(g.add_rms_norm.default, a, r, w, 1e-6, 0.0, by=PASS)
    normed, total = b.new(operator.getitem, fused, 0, by=PASS), b.new(operator.getitem, fused, 1, by=PASS)
    assert_pass_result(PASS, before, b.output(normed, total))


def test_a_sum_read_only_by_the_norm_leaves_no_second_output():
    module = AddThenNorm()
    before = aten_graph(_NormOnly(module), torch.randn(2, 8), torch.randn(2, 8))
    b = Expected()
    a, r, w = b.input((2, 8)), b.input((2, 8)), b.const("inner.weight", module.weight)
    fused = b.new(g.add_rms_norm.default, a, r, w, 1e-6, 0.0, by=PASS)
    assert_pass_result(PASS, before, b.output(b.new(operator.getitem, fused, 0, by=PASS)))


class _NormOnly(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, a, b):
        return self.inner(a, b)[0]
