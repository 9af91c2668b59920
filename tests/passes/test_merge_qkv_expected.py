"""merge_qkv, Before/Expected: the whole graph the pass leaves, node for node
(tests/passes/_before_expected.py): three projections of one input, each split into heads,
become one qkv_proj over the concatenated weights (a missing bias counts as zeros); the
views into heads read its outputs."""

import operator

import torch
from torch import nn

from tests.helpers import aten_graph
from tests.passes._before_expected import Expected, assert_pass_result

PASS = "merge_qkv"
g, aten = torch.ops.graphopt, torch.ops.aten


class Projections(nn.Module):
    """q [2 heads x 4], k and v [1 head x 4] (grouped-query); a bias on q only."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8, bias=True)
        self.k = nn.Linear(8, 4, bias=False)
        self.v = nn.Linear(8, 4, bias=False)

    def forward(self, x):
        return self.q(x).view(2, 2, 4), self.k(x).view(2, 1, 4), self.v(x).view(2, 1, 4)


def test_three_projections_become_one_qkv_proj():
    module = Projections()
    before = aten_graph(module, torch.randn(2, 8))
    b = Expected()
    x = b.input((2, 8))
    weight = b.const("qkv.weight", torch.cat([module.q.weight, module.k.weight, module.v.weight]), by=PASS)
    bias = b.const("qkv.bias", torch.cat([module.q.bias, torch.zeros(8)]), by=PASS)
    qkv = b.new(g.qkv_proj.default, x, weight, bias, [8, 4, 4], by=PASS)
    q, k, v = (b.new(operator.getitem, qkv, i, by=PASS) for i in range(3))
    views = [b.op(aten.view.default, t, shape) for t, shape in ((q, [2, 2, 4]), (k, [2, 1, 4]), (v, [2, 1, 4]))]
    assert_pass_result(PASS, before, b.output(*views))
