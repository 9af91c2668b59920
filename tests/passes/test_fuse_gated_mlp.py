"""fuse_gated_mlp: the spellings it must fuse, the near misses it must leave, numerics."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from graphopt import ir
from tests.helpers import aten_graph, assert_matches_eager, compile_with_graphopt, count, eager, run_pass

PIPE = ["canonicalize", "fuse_gated_mlp"]


class GatedMlp(nn.Module):
    """``act(gate_proj(x)) * up_proj(x)``, Llama's (silu) and Gemma's / T5's (gelu) MLP core."""

    def __init__(self, act="silu", gate_bias=False, up_bias=False, up_first=False, hidden=16, inter=32):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=gate_bias)
        self.up_proj = nn.Linear(hidden, inter, bias=up_bias)
        self.act, self.up_first = act, up_first

    def forward(self, x):
        gate = self.gate_proj(x)
        if self.act == "x_sigmoid":
            gate = gate * torch.sigmoid(gate)
        else:
            gate = F.silu(gate) if self.act == "silu" else F.gelu(gate, approximate=self.act)
        up = self.up_proj(x)
        return up * gate if self.up_first else gate * up


SPELLINGS = {
    "swiglu": (GatedMlp(), "graphopt.swiglu"),
    "swiglu_up_first": (GatedMlp(up_first=True), "graphopt.swiglu"),
    "swiglu_x_sigmoid": (GatedMlp("x_sigmoid"), "graphopt.swiglu"),
    "swiglu_x_sigmoid_up_first": (GatedMlp("x_sigmoid", up_first=True), "graphopt.swiglu"),
    "geglu_erf_biases": (GatedMlp("none", gate_bias=True, up_bias=True), "graphopt.geglu"),
    "geglu_tanh": (GatedMlp("tanh"), "graphopt.geglu"),
    "gate_bias_only": (GatedMlp(gate_bias=True), "graphopt.swiglu"),
}


def gemms(report_or_counts) -> int:
    return count(report_or_counts, "aten.mm") + count(report_or_counts, "aten.addmm")


@pytest.mark.parametrize("shape", [(2, 5, 16), (7, 16)], ids=["3d", "2d"])
@pytest.mark.parametrize("name", SPELLINGS)
def test_fuses_each_spelling_and_matches_eager(name, shape):
    module, fused_op = SPELLINGS[name]
    torch.manual_seed(0)
    x = torch.randn(*shape)
    out, report = compile_with_graphopt(module, x, passes=PIPE)
    assert count(report, fused_op) == 1
    assert gemms(report) == 1 and count(report, "aten.t") == 1
    for op in ("aten.silu", "aten.gelu", "aten.mul", "aten.sigmoid"):
        assert count(report, op) == 0, report.op_counts
    assert next(p for p in report.passes if p.name == "fuse_gated_mlp").matches == 1
    assert_matches_eager(out, eager(module, x), rel=1e-5)


def test_merged_weight_is_a_frozen_constant_behind_a_plain_linear(final_graph):
    module = GatedMlp("tanh", gate_bias=True, up_bias=False)
    compile_with_graphopt(module, torch.randn(2, 3, 16), passes=PIPE)
    gm = final_graph[-1]
    (gemm,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.addmm.default]
    bias, _, weight_t = gemm.args
    assert weight_t.target is torch.ops.aten.t.default  # still t + mm: INT4 quantization sees a linear
    weight = ir.get_constant(weight_t.args[0])
    expected = torch.cat([module.gate_proj.weight, module.up_proj.weight])
    assert weight is not None and torch.equal(weight, expected)
    assert weight_t.args[0].meta[ir.PARAM_NAME].endswith("gate_up_proj.weight")
    assert torch.equal(ir.get_constant(bias), torch.cat([module.gate_proj.bias, torch.zeros(32)]))
    assert bias.meta[ir.PARAM_NAME].endswith("gate_up_proj.bias")


def test_export_graph_keeps_aten_linear():
    torch.manual_seed(0)
    module, x = GatedMlp(), torch.randn(2, 5, 16)
    gm = aten_graph(module, x)
    assert run_pass("fuse_gated_mlp", gm).stats["matches"] == 1
    counts = ir.op_counts(gm)
    assert counts.get("aten.linear") == 1 and counts.get("graphopt.swiglu") == 1
    assert_matches_eager(gm(x)[0], eager(module, x), rel=1e-5)


def test_fp16_matches_eager():
    torch.manual_seed(0)
    module, x = GatedMlp().half(), torch.randn(4, 16).half()
    out, report = compile_with_graphopt(module, x, passes=PIPE)
    assert count(report, "graphopt.swiglu") == 1 and out.dtype == torch.float16
    assert_matches_eager(out, eager(module, x), rel=2e-3)


class DifferentInputs(GatedMlp):
    def forward(self, x, y):
        return F.silu(self.gate_proj(x)) * self.up_proj(y)


class GateOutputReused(GatedMlp):
    def forward(self, x):
        gate = self.gate_proj(x)
        return F.silu(gate) * self.up_proj(x), gate


class UpOutputReused(GatedMlp):
    def forward(self, x):
        up = self.up_proj(x)
        return F.silu(self.gate_proj(x)) * up, up


class ActivationReused(GatedMlp):
    def forward(self, x):
        act = F.silu(self.gate_proj(x))
        return act * self.up_proj(x), act


class UpWeightFromInput(GatedMlp):
    def forward(self, x, up_weight):
        return F.silu(self.gate_proj(x)) * F.linear(x, up_weight)


class BroadcastUp(GatedMlp):
    def __init__(self):
        super().__init__()
        self.up_proj = nn.Linear(16, 1, bias=False)


X = torch.randn(2, 3, 16)


@pytest.mark.parametrize(
    "module, inputs, options, reason",
    [
        (DifferentInputs(), (X, torch.randn(2, 3, 16)), {}, "gate and up read different inputs"),
        (GateOutputReused(), (X,), {}, "gate output has 2 users"),
        (UpOutputReused(), (X,), {}, "up output has 2 users"),
        (ActivationReused(), (X,), {}, "gate activation has 2 users"),
        (GatedMlp(), (X,), {"freeze_weights": False},
         "gate projection weight is not a constant (freeze_weights=False?)"),
        (UpWeightFromInput(), (X, torch.randn(32, 16)), {}, "up projection weight is not a constant"),
        (BroadcastUp(), (X,), {}, "gate width 32 != up width 1"),
    ],
    ids=["different_inputs", "gate_second_user", "up_second_user", "act_second_user", "not_frozen",
         "up_weight_input", "other_width"],
)
def test_skips_when_not_a_gated_mlp(module, inputs, options, reason):
    out, report = compile_with_graphopt(module, *inputs, passes=PIPE, **options)
    assert count(report, "graphopt.swiglu") == 0
    reasons = [m.reason for m in report.near_misses if m.pass_name == "fuse_gated_mlp"]
    assert [r for r in reasons if r.startswith(reason)] == [reasons[0]] and len(reasons) == 1, reasons
    assert_matches_eager(out, eager(module, *inputs), rel=1e-6)


def test_plain_gelu_mlp_is_not_a_candidate():
    """BERT's fc1 -> gelu -> fc2 has no product: no rewrite and no near miss."""
    module = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    _, report = compile_with_graphopt(module, X, passes=PIPE)
    assert count(report, "graphopt.geglu") == 0
    assert not [m for m in report.near_misses if m.pass_name == "fuse_gated_mlp"]


def test_products_without_a_gate_activation_are_screened_with_their_reason():
    class Products(nn.Module):
        def forward(self, x, y):
            return x * y + x * torch.sigmoid(y)  # x * sigmoid(y) is no g * sigmoid(g)

    result = run_pass("fuse_gated_mlp", aten_graph(Products(), torch.randn(4), torch.randn(4)))
    assert [(m.reason, m.screened) for m in result.near_misses] == [
        ("no silu, gelu or g * sigmoid(g) operand", True)] * 2


# -- one projection cut in two (Phi3's gate_up_proj, merged checkpoints) ------------------------

GATE_ACTS = {
    "silu": F.silu,
    "x_sigmoid": lambda g: g * torch.sigmoid(g),
    "sigmoid_x": lambda g: torch.sigmoid(g) * g,
    "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"),
}
CUTS = {
    "chunk": lambda y, n: y.chunk(2, dim=-1),
    "split": lambda y, n: y.split(n, dim=-1),
    "slice": lambda y, n: (y[..., :n], y[..., n:]),
    "split_sizes": lambda y, n: torch.split(y, [n, n], dim=-1),
}


class MergedGatedMlp(nn.Module):
    """``gate_up_proj`` cut in two halves; Phi3 is ``chunk``, gate first, ``up * act(gate)``."""

    def __init__(self, cut="chunk", act="silu", gate_first=True, up_first=True, bias=False, hidden=16, inter=32):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        self.cut, self.act, self.gate_first, self.up_first, self.inter = cut, act, gate_first, up_first, inter

    def forward(self, x):
        first, second = CUTS[self.cut](self.gate_up_proj(x), self.inter)
        gate, up = (first, second) if self.gate_first else (second, first)
        act = GATE_ACTS[self.act](gate)
        return up * act if self.up_first else act * up


@pytest.mark.parametrize("up_first", [True, False], ids=["up_first", "act_first"])
@pytest.mark.parametrize("act", GATE_ACTS)
@pytest.mark.parametrize("cut", CUTS)
def test_merged_projection_fuses_and_reads_the_weight_as_is(cut, act, up_first, final_graph):
    torch.manual_seed(0)
    module, x = MergedGatedMlp(cut, act, up_first=up_first), torch.randn(2, 5, 16)
    out, report = compile_with_graphopt(module, x, passes=PIPE)
    fused = "graphopt.geglu" if act.startswith("gelu") else "graphopt.swiglu"
    assert report.op_counts == {fused: 1, "aten.mm": 1, "aten.t": 1, "aten.view": 1, "aten._unsafe_view": 1}
    (weight,) = [n for n in final_graph[-1].graph.nodes if n.op == "get_attr"]
    assert ir.get_constant(weight) is not None
    assert torch.equal(ir.get_constant(weight), module.gate_up_proj.weight)  # no copy, no reorder
    assert [m for m in report.near_misses if m.pass_name == "fuse_gated_mlp"] == []
    assert_matches_eager(out, eager(module, x), rel=1e-5)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_gate_in_the_second_half_swaps_the_frozen_halves_once(bias, final_graph):
    torch.manual_seed(0)
    module, x = MergedGatedMlp(gate_first=False, bias=bias), torch.randn(7, 16)
    out, report = compile_with_graphopt(module, x, passes=PIPE)
    assert count(report, "graphopt.swiglu") == 1 and count(report, "aten.split") == 0
    weights = [ir.get_constant(n) for n in final_graph[-1].graph.nodes if n.op == "get_attr"]
    w = module.gate_up_proj.weight
    assert any(t.shape == w.shape and torch.equal(t, torch.cat([w[32:], w[:32]])) for t in weights)
    assert_matches_eager(out, eager(module, x), rel=1e-5)


class CutInThree(MergedGatedMlp):
    def forward(self, x):
        gate, up, rest = self.gate_up_proj(x).split([24, 24, 16], dim=-1)
        return F.silu(gate) * up, rest


class MergedReadWhole(MergedGatedMlp):
    def forward(self, x):
        y = self.gate_up_proj(x)
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up, y.sum()


class HalvesOfTwoProjections(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 64, bias=False), nn.Linear(16, 64, bias=False)

    def forward(self, x):
        return F.silu(self.a(x).chunk(2, -1)[0]) * self.b(x).chunk(2, -1)[1]


@pytest.mark.parametrize(
    "module, options, reason",
    [
        (CutInThree(), {}, "merged gate/up projection _unsafe_view is cut in 3 pieces, expected two halves"),
        (MergedReadWhole(), {}, "merged gate/up projection _unsafe_view is read by sum_1 (aten.sum), not only cut in "
                                "pieces along its last dim"),
        (HalvesOfTwoProjections(), {}, "gate getitem and up getitem_3 are not the two halves of one projection"),
        (MergedGatedMlp(gate_first=False), {"freeze_weights": False},
         "merged gate/up projection (gate second) weight is not a constant (freeze_weights=False?)"),
    ],
    ids=["three_pieces", "read_whole", "two_projections", "gate_second_not_frozen"],
)
def test_skips_merged_projection_that_is_not_two_halves(module, options, reason):
    x = torch.randn(2, 3, 16)
    out, report = compile_with_graphopt(module, x, passes=PIPE, **options)
    assert count(report, "graphopt.swiglu") == 0
    assert [m.reason for m in report.near_misses if m.pass_name == "fuse_gated_mlp"] == [reason]
    assert_matches_eager(out, eager(module, x), rel=1e-6)


def _llama(layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128)
    return LlamaForCausalLM(config).eval()


def test_transformers_llama_one_swiglu_per_layer():
    model, layers = _llama(), 2
    ids = torch.randint(0, 128, (2, 7))

    def logits(ids):
        return model(ids, use_cache=False).logits

    _, before = compile_with_graphopt(logits, ids, passes=["canonicalize"])
    out, report = compile_with_graphopt(logits, ids, passes=["canonicalize", "fuse_rms_norm", "fuse_gated_mlp"])
    assert count(report, "graphopt.swiglu") == layers
    assert count(report, "aten.silu") == 0
    assert gemms(report) == gemms(before) - layers  # gate and up: one GEMM per layer
    assert_matches_eager(out, eager(logits, ids), rel=1e-5)


def test_transformers_gemma_one_geglu_per_layer():
    from transformers import GemmaConfig, GemmaForCausalLM

    torch.manual_seed(0)
    config = GemmaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=16, vocab_size=128)
    model = GemmaForCausalLM(config).eval()
    ids = torch.randint(0, 128, (2, 7))

    def logits(ids):
        return model(ids, use_cache=False).logits

    out, report = compile_with_graphopt(logits, ids, passes=PIPE)
    assert count(report, "graphopt.geglu") == 2  # gelu_pytorch_tanh
    assert_matches_eager(out, eager(logits, ids), rel=1e-5)


def test_reference_llama_one_swiglu_per_layer():
    import graphopt.models as models

    model, inputs = models.build("llama-tiny"), models.example_inputs("llama-tiny")
    out, report = compile_with_graphopt(model, *inputs, passes=PIPE)
    assert count(report, "graphopt.swiglu") == models.config_of("llama-tiny").num_layers
    assert_matches_eager(out, eager(model, *inputs), rel=1e-5)


@pytest.mark.parametrize("gate_first", [True, False], ids=["gate_first", "gate_second"])
def test_export_graph_merged_projection(gate_first):
    torch.manual_seed(0)
    module, x = MergedGatedMlp(gate_first=gate_first, bias=True), torch.randn(2, 5, 16)
    gm = aten_graph(module, x)
    assert run_pass("fuse_gated_mlp", gm).stats["matches"] == 1
    counts = ir.op_counts(gm)
    assert counts.get("aten.linear") == 1 and counts.get("graphopt.swiglu") == 1 and "aten.split" not in counts
    assert_matches_eager(gm(x)[0], eager(module, x), rel=1e-5)
