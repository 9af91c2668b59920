"""fuse_gated_mlp, Before/Expected: the whole graph the pass leaves, node for node
(tests/passes/_before_expected.py): two projections merge into one GEMM over a new
constant ``cat([Wg, Wu])``; one projection cut in halves is read as it is."""

import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import aten_graph
from tests.passes._before_expected import Expected, assert_pass_result

PASS = "fuse_gated_mlp"
g, aten = torch.ops.graphopt, torch.ops.aten


class TwoProjections(nn.Module):
    """Llama's ``silu(gate(x)) * up(x)``."""

    def __init__(self, hidden=8, inter=16):
        super().__init__()
        self.gate = nn.Linear(hidden, inter, bias=False)
        self.up = nn.Linear(hidden, inter, bias=False)

    def forward(self, x):
        return F.silu(self.gate(x)) * self.up(x)


class MergedProjection(nn.Module):
    """Phi3's ``gate_up_proj`` cut in two with chunk, GELU (tanh) gate: GeGLU."""

    def __init__(self, hidden=8, inter=16):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inter, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def test_two_projections_become_one_gemm_and_swiglu():
    module = TwoProjections()
    before = aten_graph(module, torch.randn(2, 8))
    b = Expected()
    x = b.input((2, 8))
    merged = b.const("gate_up.weight", torch.cat([module.gate.weight, module.up.weight]), by=PASS)
    gate_up = b.new(aten.linear.default, x, merged, by=PASS)
    assert_pass_result(PASS, before, b.output(b.new(g.swiglu.default, gate_up, by=PASS)))


def test_a_merged_projection_is_read_whole():
    module = MergedProjection()
    before = aten_graph(module, torch.randn(2, 8))
    b = Expected()
    x, w = b.input((2, 8)), b.const("gate_up.weight", module.gate_up.weight)
    gate_up = b.op(aten.linear.default, x, w)
    assert_pass_result(PASS, before, b.output(b.new(g.geglu.default, gate_up, "tanh", by=PASS)))
