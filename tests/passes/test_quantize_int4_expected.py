"""quantize_int4, Before/Expected: the whole graph the pass leaves, node for node
(tests/passes/_before_expected.py): a linear on a frozen weight becomes int4_linear on new
constants holding exactly what graphopt.quant.groupwise.quantize_int4 makes of the weight
(round-to-nearest here, so no calibration run is involved)."""

import torch
from torch import nn

from graphopt.quant.groupwise import quantize_int4
from tests.helpers import aten_graph
from tests.passes._before_expected import Expected, assert_pass_result

PASS = "quantize_int4"
g, aten = torch.ops.graphopt, torch.ops.aten


class LinearRelu(nn.Module):
    """A linear whose result is not a graph output (an output would be an LM head: 8 bits)."""

    def __init__(self, bias=False):
        super().__init__()
        self.proj = nn.Linear(64, 16, bias=bias)

    def forward(self, x):
        return torch.relu(self.proj(x))


def test_a_linear_becomes_int4_linear_on_the_quantized_weight():
    for bias in (False, True):
        module = LinearRelu(bias)
        before = aten_graph(module, torch.randn(2, 64))
        q = quantize_int4(module.proj.weight.detach(), 32, True, torch.float32, "rtn")
        b = Expected()
        x = b.input((2, 64))
        bias_node = b.const("proj.bias", module.proj.bias) if bias else None
        packed = b.const("proj.weight.qweight", q.packed, by=PASS)
        scales = b.const("proj.weight.scales", q.scales, by=PASS)
        gemm = b.new(g.int4_linear.default, x, packed, scales, None, 32, bias_node, by=PASS)
        expected = b.output(b.op(aten.relu.default, gemm))
        assert_pass_result(PASS, before, expected, search="rtn", symmetric=True)
