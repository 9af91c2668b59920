"""keep_checkpoint_quantization, Before/Expected: the whole graph the pass leaves, node for
node (tests/passes/_before_expected.py): a linear on a lazy weight the checkpoint ships in
8-bit blocks becomes quantized_linear on new lazy constants that read exactly the file's
codes and scales (the helper materializes them to compare)."""

import torch
from torch import nn

from graphopt import lazy_weights
from graphopt.ops.quant_blocks import BlockFormat
from tests.helpers import aten_graph
from tests.ops.test_quant_blocks import random_blocks
from tests.passes._before_expected import Expected, assert_pass_result
from tests.passes.test_keep_checkpoint_quantization import BlockSource

PASS = "keep_checkpoint_quantization"
g = torch.ops.graphopt


class Proj(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 8, bias=False)

    def forward(self, x):
        return self.proj(x)


def test_a_lazy_block_quantized_linear_keeps_the_files_codes():
    blocks = random_blocks(8, 32, BlockFormat(8, 32, False, False), seed=1)
    module = Proj().eval()
    lazy_weights.replace_parameters(module, {"proj.weight": BlockSource(blocks)})
    before = aten_graph(module, torch.randn(2, 32))
    b = Expected()
    x = b.input((2, 32))
    codes = b.const("proj.weight.codes", torch.from_numpy(blocks.codes), by=PASS)
    scales = b.const("proj.weight.scales", torch.from_numpy(blocks.scales), by=PASS)
    gemm = b.new(g.quantized_linear.default, x, codes, scales, None, None, 8, 32, None, by=PASS)
    assert_pass_result(PASS, before, b.output(gemm))
