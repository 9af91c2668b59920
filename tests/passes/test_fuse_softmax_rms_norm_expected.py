"""fuse_softmax_rms_norm, Before/Expected: the whole graph the pass leaves, node for node
(tests/passes/_before_expected.py)."""

import torch
from torch import nn

from tests.helpers import aten_graph
from tests.passes._before_expected import Expected, assert_pass_result

PASS = "fuse_softmax_rms_norm"
g = torch.ops.graphopt


class SoftmaxThenNorm(nn.Module):
    def __init__(self, upcast=False, hidden=8, dtype=torch.float32):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(hidden, dtype=dtype))
        self.upcast = upcast

    def forward(self, x):
        # the Hugging Face router spelling rounds float32 probabilities back to x's dtype
        probs = torch.softmax(x.float(), -1).to(x.dtype) if self.upcast else torch.softmax(x, -1)
        return g.rms_norm(probs, self.weight, 1e-6, 0.0)


def test_softmax_and_norm_become_one_op():
    module = SoftmaxThenNorm()
    before = aten_graph(module, torch.randn(2, 8))
    b = Expected()
    x, w = b.input((2, 8)), b.const("weight", module.weight)
    assert_pass_result(PASS, before, b.output(b.new(g.softmax_rms_norm.default, x, w, 1e-6, 0.0, by=PASS)))


def test_the_upcast_router_spelling_reads_the_half_tensor():
    module = SoftmaxThenNorm(upcast=True, dtype=torch.float16)
    before = aten_graph(module, torch.randn(2, 8).half())
    b = Expected()
    x, w = b.input((2, 8), torch.float16), b.const("weight", module.weight)
    assert_pass_result(PASS, before, b.output(b.new(g.softmax_rms_norm.default, x, w, 1e-6, 0.0, by=PASS)))
