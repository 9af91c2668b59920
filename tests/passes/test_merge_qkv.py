"""merge_qkv: the projections it must merge, the ones it must leave, numerics."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from graphopt import ir
from tests.helpers import aten_graph, assert_matches_eager, compile_with_graphopt, count, eager, run_pass

PIPE = ["canonicalize", "merge_qkv"]
QKV = "graphopt.qkv_proj"


class Attention(nn.Module):
    """q/k/v projections split into heads, SDPA with grouped-query heads, an output projection."""

    def __init__(self, hidden=32, heads=4, kv_heads=4, bias=(False, False, False)):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        kv = kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, hidden, bias=bias[0])
        self.k_proj = nn.Linear(hidden, kv, bias=bias[1])
        self.v_proj = nn.Linear(hidden, kv, bias=bias[2])
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def split(self, t, heads):
        return t.view(*t.shape[:-1], heads, self.head_dim).transpose(-3, -2)

    def forward(self, x):
        q = self.split(self.q_proj(x), self.heads)
        k = self.split(self.k_proj(x), self.kv_heads)
        v = self.split(self.v_proj(x), self.kv_heads)
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(-3, -2).flatten(-2))


SPELLINGS = {
    "mha": Attention(),
    "gqa": Attention(kv_heads=2),
    "mqa_biases": Attention(kv_heads=1, bias=(True, True, True)),
    "bias_on_q_only": Attention(kv_heads=2, bias=(True, False, False)),
}


def gemms(report_or_counts) -> int:
    return count(report_or_counts, "aten.mm") + count(report_or_counts, "aten.addmm")


@pytest.mark.parametrize("shape", [(2, 5, 32), (2, 1, 32)], ids=["prefill", "one_token"])
@pytest.mark.parametrize("name", SPELLINGS)
def test_merges_each_spelling_and_matches_eager(name, shape):
    module = SPELLINGS[name]
    torch.manual_seed(0)
    x = torch.randn(*shape)
    out, report = compile_with_graphopt(module, x, passes=PIPE)
    assert count(report, QKV) == 1
    assert gemms(report) == 1  # only o_proj is left
    assert next(p for p in report.passes if p.name == "merge_qkv").matches == 1
    assert_matches_eager(out, eager(module, x), rel=1e-5)


def test_merged_weight_and_bias_are_frozen_constants(final_graph):
    module = Attention(kv_heads=2, bias=(True, True, False))
    compile_with_graphopt(module, torch.randn(2, 5, 32), passes=PIPE)
    (node,) = [n for n in final_graph[-1].graph.nodes if n.target is torch.ops.graphopt.qkv_proj.default]
    x, weight, bias, sizes = node.args
    assert sizes == [32, 16, 16]
    assert x.target is torch.ops.aten.view.default and list(x.meta["val"].shape) == [10, 32]
    expected = torch.cat([module.q_proj.weight, module.k_proj.weight, module.v_proj.weight])
    assert torch.equal(ir.get_constant(weight), expected)
    assert torch.equal(ir.get_constant(bias), torch.cat([module.q_proj.bias, module.k_proj.bias, torch.zeros(16)]))
    assert weight.meta[ir.PARAM_NAME].endswith("qkv_proj.weight")
    assert bias.meta[ir.PARAM_NAME].endswith("qkv_proj.bias")


def test_export_graph_with_aten_linear():
    torch.manual_seed(0)
    module, x = Attention(kv_heads=2, bias=(True, True, True)), torch.randn(2, 5, 32)
    gm = aten_graph(module, x)
    assert run_pass("merge_qkv", gm).stats["matches"] == 1
    counts = ir.op_counts(gm)
    assert counts.get(QKV) == 1 and counts.get("aten.linear") == 1
    assert_matches_eager(gm(x)[0], eager(module, x), rel=1e-5)


class CrossAttention(Attention):
    """q reads the decoder stream, k and v the encoder's: different inputs."""

    def forward(self, x, memory):
        q = self.split(self.q_proj(x), self.heads)
        k = self.split(self.k_proj(memory), self.kv_heads)
        v = self.split(self.v_proj(memory), self.kv_heads)
        return F.scaled_dot_product_attention(q, k, v)


class KeyReadsOtherK(Attention):
    """k multiplies x viewed as [2M, K/2]: the same tensor, a different matrix."""

    def __init__(self):
        super().__init__(hidden=32, heads=4)
        self.k_proj = nn.Linear(16, 32, bias=False)

    def forward(self, x):
        q = self.q_proj(x).view(-1, 4, 8)
        k = self.k_proj(x.reshape(-1, 16)).view(-1, 4, 8)
        v = self.v_proj(x).view(-1, 4, 8)
        return q, k, v


class NotSplitIntoHeads(Attention):
    """Three projections of one input that are not attention heads (a parallel MLP, say)."""

    def forward(self, x):
        return self.q_proj(x) * self.k_proj(x) + self.v_proj(x)


X = torch.randn(2, 5, 32)


@pytest.mark.parametrize(
    "module, inputs, options, reasons",
    [
        (CrossAttention(), (X, torch.randn(2, 7, 32)), {},
         ["only 1 linear(s) split into heads read arg1_1; q, k and v must read the same input",
          "only 2 linear(s) split into heads read arg3_1; q, k and v must read the same input"]),
        (Attention(kv_heads=2), (X,), {"freeze_weights": False},
         ["projection mm weight is not a constant (freeze_weights=False?)"]),
        (KeyReadsOtherK(), (X,), {}, ["mm_1 reads arg1_1 as [20, 16], mm as [10, 32] (a different K)"]),
    ],
    ids=["different_inputs", "not_frozen", "other_k"],
)
def test_skips_when_not_one_qkv_group(module, inputs, options, reasons):
    out, report = compile_with_graphopt(module, *inputs, passes=PIPE, **options)
    assert count(report, QKV) == 0
    assert [m.reason for m in report.near_misses if m.pass_name == "merge_qkv"] == reasons
    assert_matches_eager(out, eager(module, *inputs), rel=1e-6)


def test_skips_projections_not_split_into_heads():
    module = NotSplitIntoHeads()
    out, report = compile_with_graphopt(module, X, passes=PIPE)
    assert count(report, QKV) == 0 and gemms(report) == 3
    assert [m for m in report.near_misses if m.pass_name == "merge_qkv"] == []
    result = run_pass("merge_qkv", aten_graph(module, X))  # screened: --why still says why
    assert [(m.reason, m.screened) for m in result.near_misses] == [("output is not split into attention heads",
                                                                     True)] * 3
    assert_matches_eager(out, eager(module, X), rel=1e-6)


def test_k_and_v_are_screened_as_part_of_the_first_projection():
    result = run_pass("merge_qkv", aten_graph(Attention(kv_heads=2), X))
    assert result.stats["matches"] == 1
    assert sorted((m.reason, m.screened) for m in result.near_misses) == [
        ("output is not split into attention heads", True)]  # o_proj; k and v went with q


# -- one projection already holding q, k and v (Phi3's qkv_proj) -------------------------------


class MergedAttention(nn.Module):
    """``qkv_proj`` cut into q, k, v by slicing (Phi3) or ``split``, then GQA attention."""

    def __init__(self, hidden=32, heads=4, kv_heads=2, cut="slice", bias=False):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.cut = heads, kv_heads, hidden // heads, cut
        self.qkv_proj = nn.Linear(hidden, (heads + 2 * kv_heads) * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def split(self, t):
        return t.view(*t.shape[:-1], -1, self.head_dim).transpose(-3, -2)

    def forward(self, x):
        qkv = self.qkv_proj(x)
        q_end, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        if self.cut == "slice":
            q, k, v = qkv[..., :q_end], qkv[..., q_end:q_end + kv], qkv[..., q_end + kv:]
        else:
            q, k, v = qkv.split([q_end, kv, kv], dim=-1)
        out = F.scaled_dot_product_attention(self.split(q), self.split(k), self.split(v), enable_gqa=True)
        return self.o_proj(out.transpose(-3, -2).flatten(-2))


@pytest.mark.parametrize("shape", [(2, 5, 32), (5, 32)], ids=["3d", "2d"])
@pytest.mark.parametrize("cut, bias", [("slice", False), ("split", True)], ids=["slice", "split_bias"])
def test_merged_projection_becomes_qkv_proj_over_its_own_weight(cut, bias, shape, final_graph):
    torch.manual_seed(0)
    module, x = MergedAttention(cut=cut, bias=bias), torch.randn(*shape)
    out, report = compile_with_graphopt(module, x, passes=PIPE)
    assert count(report, QKV) == 1 and gemms(report) == 1  # o_proj
    assert count(report, "aten.slice") == 0 and count(report, "aten.split") == 0
    (node,) = [n for n in final_graph[-1].graph.nodes if n.target is torch.ops.graphopt.qkv_proj.default]
    x_node, weight, b, sizes = node.args
    assert sizes == [32, 16, 16]
    assert x_node.op == "placeholder"  # the [..., K] input itself: the pieces keep its leading dims
    assert ir.get_constant(weight) is not None and torch.equal(ir.get_constant(weight), module.qkv_proj.weight)
    assert (b is None) == (not bias)
    assert [m for m in report.near_misses if m.pass_name == "merge_qkv"] == []
    assert_matches_eager(out, eager(module, x), rel=1e-5)


class MergedQAndKv(MergedAttention):
    """q and a [k | v] piece: two pieces, k and v cut later from the heads."""

    def forward(self, x):
        q, kv = self.qkv_proj(x).split([32, 32], dim=-1)
        k, v = self.split(kv).chunk(2, dim=-3)
        return F.scaled_dot_product_attention(self.split(q), k, v, enable_gqa=True)


class MergedAlsoReadWhole(MergedAttention):
    def forward(self, x):
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([32, 16, 16], dim=-1)
        return F.scaled_dot_product_attention(self.split(q), self.split(k), self.split(v), enable_gqa=True), qkv


@pytest.mark.parametrize(
    "module, reason",
    [
        (MergedQAndKv(), "merged projection _unsafe_view is cut in 2 pieces, expected q, k and v"),
        (MergedAlsoReadWhole(), "merged projection _unsafe_view is read by output (output), not only cut in "
                                "pieces along its last dim"),
    ],
    ids=["two_pieces", "read_whole"],
)
def test_skips_merged_projection_not_cut_into_q_k_v(module, reason):
    out, report = compile_with_graphopt(module, X, passes=PIPE)
    assert count(report, QKV) == 0
    assert [m.reason for m in report.near_misses if m.pass_name == "merge_qkv"] == [reason]
    assert_matches_eager(out, eager(module, X), rel=1e-6)


def _check_model(model_fn, inputs, layers, pipeline):
    _, before = compile_with_graphopt(model_fn, *inputs, passes=[p for p in pipeline if p != "merge_qkv"])
    out, report = compile_with_graphopt(model_fn, *inputs, passes=pipeline)
    assert count(report, QKV) == layers
    assert gemms(report) == gemms(before) - 3 * layers  # q, k and v GEMMs became one qkv_proj each
    assert_matches_eager(out, eager(model_fn, *inputs), rel=1e-5)
    return report


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_transformers_llama_one_qkv_per_layer(kv_heads):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=kv_heads,
                                         vocab_size=128)).eval()
    ids = torch.randint(0, 128, (2, 7))

    def logits(ids):
        return model(ids, use_cache=False).logits

    # merge_qkv first: the MLP's gate/up pair (one input, no heads) must stay for fuse_gated_mlp.
    report = _check_model(logits, (ids,), 2, ["canonicalize", "fuse_rms_norm", "merge_qkv", "fuse_gated_mlp"])
    assert count(report, "graphopt.swiglu") == 2


def test_transformers_qwen2_with_qkv_biases():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128)).eval()
    ids = torch.randint(0, 128, (2, 7))

    def logits(ids):
        return model(ids, use_cache=False).logits

    report = _check_model(logits, (ids,), 2, ["canonicalize", "fuse_gated_mlp", "merge_qkv"])
    assert count(report, "aten.addmm") == 0  # the biases went into qkv_proj


def test_transformers_bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, vocab_size=128)).eval()
    ids = torch.randint(0, 128, (2, 7))

    def hidden(ids):
        return model(ids).last_hidden_state

    _check_model(hidden, (ids,), 2, PIPE)


@pytest.mark.parametrize("name", ["llama-tiny", "bert-tiny"])
def test_reference_models_one_qkv_per_layer(name):
    import graphopt.models as models

    model, inputs = models.build(name), models.example_inputs(name)
    _check_model(model, inputs, models.config_of(name).num_layers, PIPE)


def test_export_graph_merged_projection():
    torch.manual_seed(0)
    module, x = MergedAttention(bias=True), torch.randn(2, 5, 32)
    gm = aten_graph(module, x)
    assert run_pass("merge_qkv", gm).stats["matches"] == 1
    counts = ir.op_counts(gm)
    assert counts.get(QKV) == 1 and counts.get("aten.linear") == 1 and "aten.slice" not in counts
    assert_matches_eager(gm(x)[0], eager(module, x), rel=1e-5)
