"""--int4's default method, picked by held-out perplexity (benchmarks/int4_study.py):
asymmetric round-to-nearest in groups of 32, which needs no calibration run, so a checkpoint's
weights stream from the file; GPTQ is what a calibration text asks for."""

import torch
from torch import nn

from graphopt import ir
from graphopt.cli.calibration import with_int4_options
from graphopt.config import Options
from graphopt.ops.quant import dequantize_int4
from graphopt.passes.quantize_int4 import INT4_META, Int4Options
from graphopt.quant.groupwise import quantize_int4
from tests.helpers import aten_graph, run_pass

int4_op = torch.ops.graphopt.int4_linear.default


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 96, bias=False)
        self.down = nn.Linear(96, 64, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) + 1  # + 1: down's result is no graph output (no LM head)


def test_default_options_quantize_each_weight_as_asymmetric_rtn_in_groups_of_32():
    torch.manual_seed(0)
    module, x = TwoLinears(), torch.randn(3, 64)
    result = run_pass("quantize_int4", aten_graph(module, x))
    nodes = [n for n in result.gm.graph.nodes if n.target is int4_op]
    assert len(nodes) == 2
    assert result.stats["calibration"] == "none"  # no calibration run: nothing but the weights is read
    weights = {"up": module.up.weight, "down": module.down.weight}
    for node in nodes:
        name = next(k for k in weights if node.meta[INT4_META]["name"].endswith(k + ".weight"))
        packed, scales, zeros = (ir.get_constant(a) for a in node.args[1:4])
        assert zeros is not None and node.args[4] == 32
        expected = quantize_int4(weights[name].detach(), 32, symmetric=False, scale_dtype="float32", search="rtn")
        assert torch.equal(dequantize_int4(packed, scales, zeros, 32, weights[name].shape[1]), expected.dequantize())


def test_the_default_is_asymmetric_rtn_and_gptq_stays_opt_in():
    assert (Int4Options().search, Int4Options().symmetric) == ("rtn", False)


def test_a_calibration_text_asks_for_gptq_unless_a_search_is_given():
    calibrated = with_int4_options(Options(), [5, 6, 7], None)
    assert calibrated.pass_options["quantize_int4"] == {"calibration": [5, 6, 7], "search": "gptq"}
    chosen = Options.parse({"pass_options": {"quantize_int4": {"search": "mse"}}})
    assert with_int4_options(chosen, [5, 6, 7], None).pass_options["quantize_int4"]["search"] == "mse"
    assert "search" not in with_int4_options(Options(), None, 0.2).pass_options["quantize_int4"]
