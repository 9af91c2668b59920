"""schedule_weight_loads: where each layer's weight loads land, what stays put, the byte
cap, and that the graph computes exactly the same thing afterwards."""

import pytest
import torch
from torch import nn

import graphopt
from graphopt import ir, models
from graphopt.compiler import run_pipeline
from graphopt.config import Options
from graphopt.errors import OptionsError
from graphopt.pipeline import build_pass_manager
from graphopt.passes.schedule_weight_loads import COMPUTE_OPS, SCHEDULE_META
from tests.helpers import aten_graph, run_pass

QUANT = ["canonicalize", "quantize_int4"]


class Stack(nn.Module):
    """Four linears with elementwise work between them: four computes, four load sets."""

    def __init__(self, width=64, depth=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=i % 2 == 0) for i in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x)) * 0.5 + x
        return x


def quantized_graph(module, x, pipeline=QUANT):
    gm = aten_graph(module, x)
    result, _ = run_pipeline(gm, Options.parse({"pipeline": pipeline}), None)
    return result.gm


def computes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in COMPUTE_OPS]


def weight_loads(gm, compute):
    return [a for a in compute.all_input_nodes if a.op == "get_attr"]


def positions(gm):
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def others(gm):
    """The names of every node that is not a constant, in program order."""
    return [n.name for n in gm.graph.nodes if n.op != "get_attr"]


@pytest.mark.parametrize("lookahead", [0, 1, 2])
def test_loads_sit_lookahead_computes_ahead(lookahead):
    torch.manual_seed(0)
    module, x = Stack(), torch.randn(3, 64)
    gm = quantized_graph(module, x)
    before, expected = others(gm), gm(x)
    result = run_pass("schedule_weight_loads", gm, lookahead=lookahead)
    out = result.gm
    pos, cs = positions(out), computes(out)
    assert len(cs) == 4 and all(c.target is torch.ops.graphopt.int4_linear.default for c in cs)
    first_op = next(i for i, n in enumerate(out.graph.nodes) if n.op not in ("placeholder", "get_attr"))
    for i, compute in enumerate(cs):
        loads = weight_loads(out, compute)
        assert len(loads) >= 2  # packed codes, scales (and the bias of even layers)
        for load in loads:
            meta = load.meta[SCHEDULE_META]
            assert meta["for"] == compute.name
            if lookahead and i == 0:
                assert pos[load] < first_op and meta["overlaps"] is None  # nothing to overlap but the prologue
                continue
            ahead = cs[max(i - lookahead, 0)]
            assert pos[load] < pos[ahead] and meta["overlaps"] == (ahead.name if ahead is not compute else None)
            # ... and after the compute before that one: issued as late as the lookahead allows.
            if i - lookahead - 1 >= 0:
                assert pos[load] > pos[cs[i - lookahead - 1]]
    assert others(out) == before, "only weight loads may move"
    assert torch.equal(out(x)[0], expected[0])
    assert result.stats["matches"] == 4 and len(result.stats["decisions"]) == 4
    assert result.stats["loads_moved"] == sum(len(weight_loads(out, c)) for c in cs)


def test_decisions_name_the_overlapped_compute_and_bytes():
    torch.manual_seed(0)
    gm = quantized_graph(Stack(depth=3), torch.randn(2, 64))
    result = run_pass("schedule_weight_loads", gm)
    first, second, third = result.stats["decisions"]
    assert first["placed"] == "top of graph" and first["overlaps"] is None
    assert second["overlaps"] == first["compute"] and second["placed"] == f"before {first['compute']}"
    # 64 x 64 int4 codes + 64 x 2 fp16 scales (+ the fp32 bias of layer 0 and 2).
    assert first["bytes"] == 64 * 32 + 64 * 2 * 2 + 64 * 4 and second["bytes"] == 64 * 32 + 64 * 2 * 2
    assert second["inflight_bytes"] == first["bytes"] + second["bytes"]  # both fetched, neither consumed yet
    # The printed IR (graphopt debug --print-ir-after schedule_weight_loads) says it too.
    text = ir.format_graph(result.gm)
    assert f"// load for %{second['compute']}, overlaps %{first['compute']}" in text


@pytest.mark.parametrize("cap_layers, ahead", [(0, 2), (2.2, 1), (1.5, 0)])
def test_byte_cap_shortens_the_lookahead(cap_layers, ahead):
    torch.manual_seed(0)
    gm = quantized_graph(Stack(depth=4), torch.randn(2, 64))
    layer = 64 * 32 + 64 * 2 * 2 + 64 * 4  # the larger (biased) layers' bytes
    cap = int(cap_layers * layer)
    result = run_pass("schedule_weight_loads", gm, lookahead=2, max_inflight_bytes=cap)
    decisions = result.stats["decisions"]
    names = [d["compute"] for d in decisions]
    # A layer's loads stay in flight until its compute ends: two layers fit in 2.2, not in 1.5.
    for i, d in enumerate(decisions[1:], start=1):
        assert d["overlaps"] == (names[max(i - ahead, 0)] if ahead else None), (cap, decisions)
        assert not cap or d["inflight_bytes"] <= cap
    assert torch.equal(result.gm(torch.ones(2, 64))[0], gm(torch.ones(2, 64))[0])


class WeightAlsoReadEarly(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(32, 32, bias=False)
        self.second = nn.Linear(32, 32, bias=False)

    def forward(self, x):
        h = self.first(x) * self.second.weight.mean()  # the second weight is read before its GEMM
        return self.second(h)


def test_skips_a_weight_another_node_reads_first():
    torch.manual_seed(0)
    module, x = WeightAlsoReadEarly(), torch.randn(4, 32)
    gm = aten_graph(module, x)  # fp32: linear against the frozen weights
    before_order, expected = others(gm), gm(x)
    weight = next(n for n in gm.graph.nodes if n.meta.get(ir.PARAM_NAME) == "second.weight")
    pos_before = positions(gm)[weight]
    result = run_pass("schedule_weight_loads", gm)
    assert SCHEDULE_META not in weight.meta and positions(result.gm)[weight] == pos_before
    second = computes(result.gm)[1]
    assert second.meta.get(SCHEDULE_META, {}).get("loads", []) == []
    assert others(result.gm) == before_order and torch.equal(result.gm(x)[0], expected[0])


def test_skips_graphs_without_computes():
    gm = aten_graph(nn.Sequential(nn.LayerNorm(16), nn.GELU()), torch.randn(2, 16))
    result = run_pass("schedule_weight_loads", gm)
    assert not result.modified and result.stats["matches"] == 0 and result.stats["decisions"] == []


def test_bad_options_fail_with_one_line():
    with pytest.raises(OptionsError, match="lookahead must be an int >= 0"):
        build_pass_manager(Options.parse(
            {"pipeline": ["schedule_weight_loads"], "pass_options": {"schedule_weight_loads": {"lookahead": -1}}}))


def test_llama_tiny_through_torch_compile_is_unchanged_numerically():
    from tests.helpers import compile_with_graphopt, eager

    model, inputs = models.build("llama-tiny"), models.example_inputs("llama-tiny")
    pipe = ["canonicalize", "fuse_rms_norm", "merge_qkv", "fuse_gated_mlp", "quantize_int4"]
    plain, _ = compile_with_graphopt(model, *inputs, passes=pipe)
    scheduled, report = compile_with_graphopt(model, *inputs, passes=[*pipe, "schedule_weight_loads"])
    record = next(p for p in report.passes if p.name == "schedule_weight_loads")
    assert record.status == "changed"
    # qkv, o_proj, gate_up, down per layer, lm_head; attention reads no weights.
    assert len(record.stats["decisions"]) == 4 * models.config_of("llama-tiny").num_layers + 1
    assert all(d["overlaps"] for d in record.stats["decisions"][1:])
    assert torch.equal(scheduled[0], plain[0])
    assert eager(model, *inputs)[0].shape == scheduled[0].shape
