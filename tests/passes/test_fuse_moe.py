"""fuse_moe: transformers' MoE blocks (Mixtral, Qwen2-MoE with its shared expert) become one
graphopt.moe; the near misses it must leave; numerics against eager (fp32, rel 1e-5)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_matches_eager, compile_with_graphopt, count, eager

transformers = pytest.importorskip("transformers")

PIPE = ["canonicalize", "fuse_gated_mlp", "fuse_moe"]
HIDDEN = 32
SMALL = dict(vocab_size=64, hidden_size=HIDDEN, intermediate_size=40, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32)


def moe_block(family: str, **config):
    """The MoE block of a one-layer model: built through the model so its config carries the
    experts implementation transformers chooses (grouped_mm), with seeded weights."""
    torch.manual_seed(0)
    if family == "mixtral":
        cfg = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **{**SMALL, **config})
        model = transformers.MixtralForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                          shared_expert_intermediate_size=40, **{**SMALL, **config})
        model = transformers.Qwen2MoeForCausalLM(cfg)
    block = model.model.layers[0].mlp.eval()
    with torch.no_grad():  # init leaves the 3-D expert weights tiny; give every expert a real say
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block


def x_in(tokens=7):
    return torch.randn(2, tokens, HIDDEN, generator=torch.Generator().manual_seed(1))


def fused(block, x=None):
    x = x_in() if x is None else x
    out, report = compile_with_graphopt(block, x, passes=PIPE)
    return out, report, eager(block, x)


CASES = {
    "mixtral": ("mixtral", {}),
    "qwen2_moe_shared_expert": ("qwen2_moe", {}),
    "qwen2_moe_renormalised": ("qwen2_moe", {"norm_topk_prob": True}),
}


@pytest.mark.parametrize("case", CASES)
def test_fuses_the_block_into_one_moe_and_matches_eager(case):
    family, config = CASES[case]
    out, report, want = fused(moe_block(family, **config))
    assert count(report, "graphopt.moe") == 1, report.op_counts
    for gone in ("transformers.grouped_mm_fallback", "aten.topk", "aten.sort", "aten.histc", "aten.sigmoid",
                 "graphopt.swiglu", "aten.mm"):
        assert count(report, gone) == 0, (gone, report.op_counts)
    assert next(p for p in report.passes if p.name == "fuse_moe").matches == 1
    assert not [m for m in report.near_misses if m.pass_name == "fuse_moe"]
    assert_matches_eager(out, want, rel=1e-5)


def test_fused_node_carries_k_normalize_and_the_shared_weights(monkeypatch):
    import graphopt.compiler

    graphs = []
    lower = graphopt.compiler.lower
    monkeypatch.setattr(graphopt.compiler, "lower", lambda gm, *a, **k: (graphs.append(gm), lower(gm, *a, **k))[1])
    for family, normalize, n_args in (("mixtral", True, 6), ("qwen2_moe", False, 9)):
        compile_with_graphopt(moe_block(family), x_in(), passes=PIPE)
        (node,) = [n for n in graphs[-1].graph.nodes if n.target is torch.ops.graphopt.moe.default]
        assert node.args[4:6] == (2, normalize) and len(node.args) == n_args
        assert all(a.op == "get_attr" for a in node.args[1:4]), "expert weights stay frozen constants"
        assert all(a is not None for a in node.args[6:])


def test_one_token_decode_shape_matches_eager():
    out, report, want = fused(moe_block("qwen2_moe"), x_in(tokens=1))
    assert count(report, "graphopt.moe") == 1
    assert_matches_eager(out, want, rel=1e-5)


def test_skips_gelu_experts_naming_the_activation():
    # GeGLU experts: graphopt.moe (and ORT's CPU MoE) computes SwiGLU only.
    out, report, want = fused(moe_block("mixtral", hidden_act="gelu_pytorch_tanh"))
    assert count(report, "graphopt.moe") == 0 and count(report, "transformers.grouped_mm_fallback") == 2
    (miss,) = [m for m in report.near_misses if m.pass_name == "fuse_moe"]
    assert "expert activation: expected graphopt.swiglu, found graphopt.geglu" in miss.reason
    assert_matches_eager(out, want, rel=1e-5)


def test_shared_expert_gate_with_a_bias_stays_outside_with_a_near_miss():
    block = moe_block("qwen2_moe")
    gate = torch.nn.Linear(HIDDEN, 1, bias=True)
    with torch.no_grad():
        gate.weight.copy_(block.shared_expert_gate.weight)
        gate.bias.fill_(0.5)
    block.shared_expert_gate = gate
    out, report, want = fused(block)
    assert count(report, "graphopt.moe") == 1 and count(report, "aten.sigmoid") == 1
    (miss,) = [m for m in report.near_misses if m.pass_name == "fuse_moe"]
    assert miss.reason.startswith("shared expert left outside:") and "bias" in miss.reason, miss.reason
    assert_matches_eager(out, want, rel=1e-5)


def test_skips_a_router_that_is_not_a_softmax():
    block = moe_block("mixtral")

    def sigmoid_router(hidden_states, router=block.gate):  # a sigmoid router (DeepSeek-V3 style)
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, HIDDEN), router.weight)
        top_v, top_i = torch.topk(torch.sigmoid(logits), router.top_k, dim=-1)
        return logits, top_v, top_i

    block.gate.forward = sigmoid_router
    out, report, want = fused(block)
    assert count(report, "graphopt.moe") == 0
    (miss,) = [m for m in report.near_misses if m.pass_name == "fuse_moe"]
    assert "router probabilities: expected aten._softmax or aten.softmax" in miss.reason, miss.reason
    assert_matches_eager(out, want, rel=1e-5)


def compile_in_pieces(module, x, **flags):
    """torch.compile without fullgraph (dynamo may break the graph), default fallback; returns
    (out, reports): the pipeline's failures on a graph are skipped, as users get them."""
    import graphopt

    torch._dynamo.reset()
    graphopt.reset()
    with torch._dynamo.config.patch(**flags):
        compiled = torch.compile(module, backend="graphopt", options={"target": "eager", "pipeline": PIPE})
        with torch.no_grad():
            out = compiled(x)
    return out, graphopt.reports()


def fuse_moe_misses(reports):
    return [(r.graph_index, m) for r in reports for m in r.near_misses if m.pass_name == "fuse_moe"]


@pytest.mark.parametrize("flags", [{}, {"capture_dynamic_output_shape_ops": True}], ids=["default", "capture_nonzero"])
def test_skips_the_eager_experts_loop_naming_the_graph_break(flags):
    # transformers' own eager experts (for expert in nonzero(hit): ... index_add_): dynamo breaks
    # the graph at that loop, with or without capturing nonzero, so no graph holds router and experts.
    block = moe_block("mixtral", experts_implementation="eager")
    x = x_in()
    out, reports = compile_in_pieces(block, x, **flags)
    assert len(reports) > 1, "dynamo broke the block into several graphs"
    assert all(count(r, "graphopt.moe") == 0 for r in reports)
    ((graph, miss),) = fuse_moe_misses(reports)
    assert graph == 0 and miss.node == "topk", miss
    assert "expert ids leave the graph" in miss.reason and "experts_implementation='grouped_mm'" in miss.reason
    assert_matches_eager(out, eager(block, x), rel=1e-5)


class RangeLoopMoe(torch.nn.Module):
    """The expert loop of transformers 4.x's Mixtral block: for e in range(E), torch.where on
    the expert mask, gather, SwiGLU expert, index_add_ into the output. ``linears``: one
    nn.Linear-style matrix per expert and the ``x[None, token].reshape`` gather (Mixtral 4.x);
    otherwise 3-D expert weights indexed per expert. ``act`` and ``loop`` plant near misses."""

    def __init__(self, experts=4, k=2, inter=40, linears=False, act=torch.nn.functional.silu, loop=None):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.k, self.linears, self.act, self.loop = k, linears, act, loop or experts
        self.gate = torch.nn.Linear(HIDDEN, experts, bias=False)
        with torch.no_grad():
            self.gate.weight.normal_(0, 0.3, generator=g)
        w = [torch.randn(experts, *shape, generator=g) * 0.3
             for shape in ((inter, HIDDEN), (inter, HIDDEN), (HIDDEN, inter))]
        if linears:
            self.w1, self.w3, self.w2 = (torch.nn.ParameterList(list(t)) for t in w)
        else:
            self.w1, self.w3, self.w2 = (torch.nn.Parameter(t) for t in w)

    def forward(self, hidden_states):
        x = hidden_states.view(-1, HIDDEN)
        weights, chosen = torch.topk(torch.softmax(self.gate(x), dim=1, dtype=torch.float), self.k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        mask = torch.nn.functional.one_hot(chosen, num_classes=self.gate.weight.shape[0]).permute(2, 1, 0)
        for e in range(self.loop):
            slot, token = torch.where(mask[e])
            h = x[None, token].reshape(-1, HIDDEN) if self.linears else x[token]
            y = torch.nn.functional.linear(self.act(h @ self.w1[e].t()) * (h @ self.w3[e].t()), self.w2[e])
            out.index_add_(0, token, y * weights[token, slot, None])
        return out.view_as(hidden_states)


def loop_moe(block):
    """Compile the loop block with nonzero captured (dynamo then keeps the loop in one graph)."""
    x = x_in()
    out, reports = compile_in_pieces(block.eval(), x, capture_dynamic_output_shape_ops=True)
    assert len(reports) == 1, "captured as one graph"
    return out, reports[0], eager(block, x)


@pytest.mark.parametrize("linears", [False, True], ids=["3d_weights", "linear_per_expert"])
def test_fuses_the_index_add_expert_loop_captured_with_nonzero(linears):
    out, report, want = loop_moe(RangeLoopMoe(linears=linears))
    assert count(report, "graphopt.moe") == 1, report.op_counts
    for gone in ("aten.index_add", "aten.nonzero", "aten.topk", "aten.mm", "aten.index", "aten._assert_scalar",
                 "aten._assert_async"):
        assert count(report, gone) == 0, (gone, report.op_counts)
    assert next(p for p in report.passes if p.name == "fuse_moe").matches == 1
    # per-expert linears: fuse_gated_mlp has made each expert a graphopt.swiglu MLP first
    assert next(p for p in report.passes if p.name == "fuse_gated_mlp").matches == (4 if linears else 0)
    assert not [m for m in report.near_misses if m.pass_name == "fuse_moe"]
    assert_matches_eager(out, want, rel=1e-5)


@pytest.mark.parametrize("plant, reason", [
    (dict(act=torch.nn.functional.gelu), "neither operand of"),
    (dict(loop=3), "the loop adds 3 experts, the expert mask has 4"),
], ids=["gelu_experts", "loop_skips_an_expert"])
def test_skips_an_index_add_loop_that_is_not_the_op(plant, reason):
    out, report, want = loop_moe(RangeLoopMoe(**plant))
    assert count(report, "graphopt.moe") == 0 and count(report, "aten.index_add") == plant.get("loop", 4)
    (miss,) = [m for m in report.near_misses if m.pass_name == "fuse_moe"]
    assert reason in miss.reason, miss.reason
    assert_matches_eager(out, want, rel=1e-5)


def test_reference_matches_a_per_token_loop():
    """The op's dense reference against the definition, token by token (top-k, renormalise,
    SwiGLU experts, weighted sum, gated shared expert)."""
    from tests.op_cases import nonzero_random as r

    x, wr, gu, d = r(6, 8), r(5, 8), r(5, 12, 8) * 0.3, r(5, 8, 6) * 0.3
    sgu, sd, sg = r(10, 8) * 0.3, r(8, 5) * 0.3, r(1, 8)
    for normalize in (True, False):
        got = torch.ops.graphopt.moe(x, wr, gu, d, 3, normalize, sgu, sd, sg)
        want = torch.empty_like(x)
        for t in range(x.shape[0]):
            w, e = torch.softmax(wr @ x[t], -1).topk(3)
            w = w / w.sum() if normalize else w
            acc = sum(w[j] * (d[e[j]] @ (torch.nn.functional.silu((gu[e[j]] @ x[t])[:6]) * (gu[e[j]] @ x[t])[6:]))
                      for j in range(3))
            h = sgu @ x[t]
            want[t] = acc + torch.sigmoid(sg @ x[t]) * (sd @ (torch.nn.functional.silu(h[:5]) * h[5:]))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_routing_log_counts_tokens_per_expert_and_top_k_set_changes():
    from graphopt.ops.moe import record_routing

    router = torch.eye(4, 8) * 10  # token t picks the experts of its two largest features 0..3
    x1 = torch.tensor([[3.0, 2, 0, 0, 1, 1, 1, 1], [0, 0, 3, 2, 1, 1, 1, 1]])
    x2 = torch.tensor([[2.0, 3, 0, 0, 1, 1, 1, 1], [0, 3, 2, 0, 1, 1, 1, 1]])  # row 0: same set; row 1: {2,3} -> {1,2}
    gu, d = torch.randn(4, 6, 8), torch.randn(4, 8, 3)
    with record_routing() as log:
        for x in (x1, x2):
            torch.ops.graphopt.moe(x, router, gu, d, 2, True)
        torch.ops.graphopt.moe(torch.cat([x1, x2]), router, gu, d, 2, True)  # another batch size: not a step
    # pairs: {0,1} {2,3} | {0,1} {1,2} | {0,1} {2,3} {0,1} {1,2}
    assert log.tokens_per_expert() == [[4, 6, 4, 2]]
    assert log.topk_change_rate() == [0.5]


@pytest.mark.slow  # a compile and a short decode of a 2-layer Mixtral: minutes on the loaded CI machine
def test_routing_log_follows_a_decode_loop_per_layer():
    from graphopt.generation.api import generate
    from graphopt.ops.moe import record_routing

    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        num_local_experts=4, num_experts_per_tok=2, **{**SMALL, "num_hidden_layers": 2})).eval()
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    with record_routing() as log:
        generate(model, ids, 3, options={"target": "eager", "fallback": "error"})
    counts = log.tokens_per_expert()
    assert len(counts) == 2, "one entry per MoE layer"
    # prefill routes 2 x 5 tokens, then 2 decode steps route 2 tokens each, top 2 of each
    assert [sum(c) for c in counts] == [2 * (2 * 5 + 2 * 2)] * 2
    assert all(r is not None and 0.0 <= r <= 1.0 for r in log.topk_change_rate())
