"""keep_checkpoint_quantization: lazy weights a checkpoint ships block-quantized become
quantized_linear / quantized_gather on exactly those codes; float or real weights are left."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from graphopt import ir, lazy_weights
from graphopt.ops.quant_blocks import BlockFormat
from tests.helpers import aten_graph, run_pass
from tests.ops.test_quant_blocks import random_blocks

linear_op = torch.ops.graphopt.quantized_linear.default
gather_op = torch.ops.graphopt.quantized_gather.default


class BlockSource:
    """A weight the checkpoint ships as blocks (what a GGUF tensor's source offers)."""

    def __init__(self, blocks):
        self.blocks, self.dtype = blocks, torch.float32
        self.shape = (blocks.scales.shape[0], blocks.in_features)

    def load(self):
        return torch.from_numpy(self.blocks.dequantize())

    def block_format(self):
        return self.blocks.format

    def block_quantized(self, rows=None):
        return self.blocks.take_rows(rows)


class DenseSource(BlockSource):
    """A float tensor in the checkpoint: lazy, but with no blocks to keep."""

    def block_format(self):
        return None


class TinyLM(nn.Module):
    """A table tied to its head, a gated MLP (gate/up concatenated by fuse_gated_mlp) and a norm."""

    def __init__(self, vocab=40, hidden=64, inter=96):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.gate = nn.Linear(hidden, inter, bias=False)
        self.up = nn.Linear(hidden, inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=True)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.down(F.silu(self.gate(h)) * self.up(h))
        return self.head(h)


GATE = BlockFormat(8, 32, False, False)  # Q5_0 / Q8_0-like
UP = BlockFormat(4, 32, True, True)  # Q4_1 / Q4_K-like: the merged gate_up widens to 8-bit with offsets


def lazy_tiny_lm(dense: tuple[str, ...] = ()):
    model = TinyLM().eval()
    formats = {"embed.weight": BlockFormat(8, 32, False, False), "gate.weight": GATE, "up.weight": UP,
               "down.weight": BlockFormat(8, 16, False, False)}
    sources = {}
    for i, (name, fmt) in enumerate(formats.items()):
        shape = dict(model.named_parameters())[name].shape
        kind = DenseSource if name in dense else BlockSource
        sources[name] = kind(random_blocks(shape[0], shape[1], fmt, seed=10 + i))
    bias = torch.randn(64) * 0.1
    sources["down.bias"] = type("Bias", (), {"shape": (64,), "dtype": torch.float32, "load": lambda self: bias})()
    real = TinyLM().eval()  # the same weights in memory: the reference
    with torch.no_grad():
        for name, source in sources.items():
            dict(real.named_parameters())[name].copy_(source.load())
    lazy_weights.replace_parameters(model, sources)
    return model, real


IDS = torch.tensor([[1, 5, 7, 39], [0, 2, 2, 11]])


def optimized(model, passes=("fuse_gated_mlp", "keep_checkpoint_quantization")):
    gm = aten_graph(model, IDS)
    results = [run_pass(name, gm) for name in passes]
    return results[-1]


def test_quantized_weights_become_quantized_ops_with_one_set_of_constants():
    model, _ = lazy_tiny_lm()
    result = optimized(model)
    ops = ir.op_counts(result.gm)
    assert ops.get("graphopt.quantized_linear") == 3  # gate_up, down, head
    assert ops.get("graphopt.quantized_gather") == 1
    assert "aten.mm" not in ops and "aten.embedding" not in ops
    stats = result.stats
    assert stats["matches"] == 4 and stats["weights"] == 3  # the tied table and head share codes
    assert stats["formats"] == {"8-bit/32 +zeros +offsets": 1, "8-bit/16": 1, "8-bit/32": 1}
    gather = next(n for n in result.gm.graph.nodes if n.target is gather_op)
    head = next(n for n in result.gm.graph.nodes if n.target is linear_op and n.args[1] is gather.args[0])
    assert head.args[2] is gather.args[1]  # the head reads the table's very scales node


def test_the_graph_computes_with_exactly_the_files_values():
    model, real = lazy_tiny_lm()
    result = optimized(model)
    assert lazy_weights.load_constants(result.gm) > 0
    with torch.no_grad():
        out, expected = result.gm(IDS), real(IDS)
    out = out[0] if isinstance(out, (tuple, list)) else out
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_skips_weights_in_memory():
    result = optimized(TinyLM().eval())
    assert result.stats["matches"] == 0
    reasons = {m.reason for m in result.near_misses}
    assert reasons == {"weight is not a quantized checkpoint tensor"}


def test_skips_lazy_float_weights():
    model, _ = lazy_tiny_lm(dense=("down.weight",))
    result = optimized(model)
    ops = ir.op_counts(result.gm)
    assert ops.get("graphopt.quantized_linear") == 2 and ops.get("aten.addmm", 0) + ops.get("aten.linear", 0) == 1


def test_a_second_run_changes_nothing():
    model, _ = lazy_tiny_lm()
    result = optimized(model)
    again = run_pass("keep_checkpoint_quantization", result.gm)
    assert again.stats["matches"] == 0 and not again.modified


@pytest.mark.parametrize("name", ["codes", "scales", "zeros", "offsets"])
def test_each_new_constant_reads_its_own_field(name):
    model, _ = lazy_tiny_lm()
    result = optimized(model)
    gate_up = next(n for n in result.gm.graph.nodes if n.target is linear_op and n.args[4] is not None)
    node = gate_up.args[1 + ("codes", "scales", "zeros", "offsets").index(name)]
    blocks = lazy_weights.source_of(ir.get_constant(gate_up.args[1])).source.block_quantized()
    assert np.array_equal(lazy_weights.materialize(ir.get_constant(node)).numpy(), getattr(blocks, name))


def test_a_large_weight_becomes_row_blocks_with_the_same_result():
    """max_weight_bytes: the head stays whole (its table is tied); gate_up (192 x 64, 8-bit/32
    with zero points and offsets, 1.28125 bytes a weight) and down (64 x 96, 8-bit/16, 1.25)
    split into four blocks of 48 rows and two of 32."""
    model, real = lazy_tiny_lm()
    gm = aten_graph(model, IDS)
    run_pass("fuse_gated_mlp", gm)
    result = run_pass("keep_checkpoint_quantization", gm, max_weight_bytes=48 * 82)
    assert result.stats["row_blocks"] == 6 and result.stats["weights"] == 3
    linears = [n for n in result.gm.graph.nodes if n.target is linear_op]
    assert sorted(n.args[1].meta["val"].shape[0] for n in linears) == [32] * 2 + [40] + [48] * 4
    assert ir.op_counts(result.gm).get("aten.cat") == 2
    lazy_weights.load_constants(result.gm)
    with torch.no_grad():
        out, expected = result.gm(IDS), real(IDS)
    out = out[0] if isinstance(out, (tuple, list)) else out
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
