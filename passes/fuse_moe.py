"""Mixture of experts: ``softmax(x @ Wr^T) -> topk -> (w / sum w) -> sort tokens by expert
-> grouped GEMM, swiglu, grouped GEMM -> * w -> unsort -> sum over k (+ sigmoid(x @ Wsg^T) *
shared MLP)  ->  graphopt.moe(x, Wr, gate_up, down, k, normalize, shared...)``.

Why: the routed block is a sort, gathers, a histogram, two grouped GEMMs behind an opaque
custom op (transformers' ``grouped_mm_fallback``) and a scatter. No target lowers that op,
so on ONNX Runtime it cut the graph and ran eagerly; as one op it becomes ORT's ``MoE``
kernel or one Triton kernel over tokens sorted by expert.

Spelling matched: ``moe_via_grouped_mm``, transformers' ``grouped_mm`` experts
implementation (Mixtral, Qwen2-MoE, Qwen3-MoE, the default under torch.compile) as
aot_autograd writes it: ``sort(topk_index.view(-1))`` gives ``perm``; tokens are gathered
with ``x[perm // k]``, weights with ``w.view(-1)[perm]``; the expert GEMMs are
``transformers.grouped_mm_fallback`` or ``aten._grouped_mm`` against ``transpose(W, -2, -1)``
with offsets ``cumsum(histc(sorted ids))``; the activation is already ``graphopt.swiglu``
(fuse_gated_mlp runs first); the result is unsorted with ``inv_perm`` (``index_put`` of an
``arange``) and summed over k. A shared expert beside the routed ones (Qwen2-MoE) joins
when the sum's one user adds ``[sigmoid(x @ Wsg^T) *] down(swiglu(gate_up(x)))``.
Routing weights renormalised by their sum (Mixtral) set ``normalize``.

Preconditions: router, gathers and shared expert read the same [tokens, hidden] input
(through views); every weight is a frozen constant; both grouped GEMMs use the same offsets
from the same sort; the sum's input has no other reader.

Spelling matched: ``moe_via_index_add_loop``, the loop over experts of transformers 4.x
(``for e in range(E): slot, token = where(one_hot(ids).permute(2, 1, 0)[e]);
out.index_add_(0, token, expert_e(x[token]) * w[token, slot])``), which dynamo captures as one
graph only with ``torch._dynamo.config.capture_dynamic_output_shape_ops = True``: a chain of
``index_add`` from ``zeros``, one link per expert in order, each expert a SwiGLU MLP on
frozen weights (one matrix per expert, or a slice of a 3-D one), stacked into the op's
``[E, ...]`` weights; the loop's runtime size checks go with it.

Not matched, with a near miss at the router's ``topk`` that says so: transformers 5.x's loop
(its ``eager`` experts implementation) runs ``for expert in nonzero(hit)``, a trip count that
depends on the routing: dynamo breaks the graph there even with that flag, and torch.export
refuses it (a guard on a data-dependent size), so the router's expert ids leave the graph and
the experts run in others. The near miss names the grouped_mm spelling, which fuses.

Layout: this file holds the grouped_mm matcher, the shared expert and the pass; the loop
matcher and that near miss are in ``_moe_index_add.py``, the router match and the match
records both spellings share in ``_moe_routing.py``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.passes._moe_index_add import (  # GROUPED_MM_HINT re-exported: debug_cmd's MoE summary names it
    GROUPED_MM_HINT, LoopMatch, expert_loop_miss, moe_via_index_add_loop,
)
from graphopt.passes._moe_routing import (
    MoeMatch, SharedExpert, call_of_output, grouped_mm_targets, match_routing, through_views, upstream,
)
from graphopt.rewrite import (
    MUL_OPS, SOFTMAX_OPS, VIEW_OPS, NoMatch, PatternPass, call_args, commuted, expect, expect_op, is_cast, is_op,
    strip_casts, val,
)
from graphopt.rewrite.linears import expect_constant_params, linear_producing

aten = torch.ops.aten
graphopt = torch.ops.graphopt


def _expert_weights(weight_t: fx.Node, what: str) -> tuple[fx.Node, bool]:
    """The frozen per-expert weight a grouped GEMM multiplies by [E, in, out], and whether
    it is stored that way (True) or as nn.Linear's [E, out, in] read through a transpose."""
    stored_transposed = not (is_op(weight_t, aten.transpose.int)
                             and sorted(d % 3 for d in weight_t.args[1:3]) == [1, 2])
    weight = weight_t if stored_transposed else weight_t.args[0]
    expect(ir.get_constant(weight) is not None, f"{what} weights are not a constant (freeze_weights=False?)", weight)
    return weight, stored_transposed


def _grouped_mm(node, what: str) -> tuple[fx.Node, fx.Node, fx.Node]:
    """(input, weight [E, in, out], offsets) of a grouped GEMM without bias."""
    expect_op(node, grouped_mm_targets(), what)
    args = call_args(node)
    expect(args.get("bias") is None, f"{what} has a bias", node)
    weight = args.get("weight", args.get("mat2"))
    return args["input"] if "input" in args else args["self"], weight, args["offs"]


def moe_via_grouped_mm(combine: fx.Node) -> MoeMatch:
    """Match from ``sum(view(unsorted, [T, k, H]), [1])`` back to the router."""
    grouped = expect_op(combine.args[0], VIEW_OPS, "top-k sum input")
    expect(len(grouped.users) == 1, "the [tokens, k, hidden] outputs have other readers", grouped)
    unsorted = expect_op(grouped.args[0], (aten.index.Tensor,), "expert outputs in token order")
    weighted, (inv_perm,) = unsorted.args[0], unsorted.args[1]
    expect_op(inv_perm, (aten.index_put.default,), "inverse permutation")
    perm_node = inv_perm.args[1][0]
    # one (token, slot) pair: aot views the arange down to a 0-d value
    expect(is_op(through_views(inv_perm.args[2]), aten.arange.default, aten.arange.start),
           "inverse permutation does not scatter an arange", inv_perm)
    expect_op(strip_casts(weighted), MUL_OPS, "weighted expert outputs")
    weighted = strip_casts(weighted)

    def is_weight(v):
        return is_op(v, aten.unsqueeze.default) and is_op(v.args[0], aten.index.Tensor)

    scale, expert_out = commuted(weighted, is_weight, "routing weights gathered in expert order")
    sorted_w = scale.args[0]
    expect(sorted_w.args[1][0] is perm_node, "routing weights are not gathered with the sort's permutation", sorted_w)
    act, down_t, offsets = _grouped_mm(strip_casts(expert_out), "down projection")
    expect_op(act, (graphopt.swiglu.default,), "expert activation")
    hidden_up, gate_up_t, offsets_up = _grouped_mm(act.args[0], "gate/up projection")
    expect(offsets_up is offsets, "the two grouped GEMMs use different offsets", offsets_up)

    sort = call_of_output(perm_node, 1, (aten.sort.default, aten.sort.stable), "token permutation")
    ids = through_views(sort.args[0])
    routing = match_routing(through_views(sorted_w.args[0]), ids)
    k = routing.k
    _check_offsets(offsets, sort, val(routing.router.weight).shape[0])

    gathered = expect_op(hidden_up, (aten.index.Tensor,), "tokens gathered in expert order")
    token_of = gathered.args[1][0]
    expect(is_op(token_of, aten.floor_divide.default, aten.div.Tensor_mode) and token_of.args[0] is perm_node
           and token_of.args[1] == k, f"tokens are not gathered with perm // {k}", token_of)
    x = gathered.args[0]
    expect(through_views(x) is through_views(routing.router.x2d) and val(x).dim() == 2,
           "router and experts read different inputs", x)
    gate_up, down = _expert_weights(gate_up_t, "gate/up"), _expert_weights(down_t, "down")
    return MoeMatch(combine, x, routing, gate_up, down)


def _check_offsets(offsets, sort, experts: int) -> None:
    """offsets = cumsum(histc(sorted ids, bins=E, min=0, max=E-1))."""
    expect_op(offsets, (aten.cumsum.default,), "grouped GEMM offsets")
    hist = expect_op(strip_casts(offsets.args[0]), (aten.histc.default,), "tokens per expert")
    source = strip_casts(hist.args[0])
    expect(is_op(source, operator.getitem) and source.args[0] is sort and source.args[1] == 0,
           "tokens per expert are not counted from the sorted expert ids", hist)
    args = call_args(hist)
    expect((args["bins"], args["min"], args["max"]) == (experts, 0, experts - 1),
           f"tokens per expert: histc bins {args['bins']} over [{args['min']}, {args['max']}], "
           f"expected {experts} over [0, {experts - 1}]", hist)


def shared_expert(total: fx.Node, routed: fx.Node, x: fx.Node) -> SharedExpert:
    """``routed + [sigmoid(x @ Wsg^T) *] down(swiglu(x @ Wgu^T))``."""
    other = total.args[1] if total.args[0] is routed else total.args[0]
    gate = None
    shared_out = other
    if is_op(other, *MUL_OPS):
        sig, shared_out = commuted(other, lambda v: is_op(v, aten.sigmoid.default), "a sigmoid gate")
        gate = linear_producing(sig.args[0], "shared expert gate")
        expect(gate.width == 1, f"shared expert gate has {gate.width} outputs, expected 1", gate.gemm)
        expect(gate.bias is None, "shared expert gate has a bias (graphopt.moe has none)", gate.bias)
        expect_constant_params(gate, "shared expert gate")
    down = linear_producing(shared_out, "shared expert down projection")
    act = expect_op(down.x2d, (graphopt.swiglu.default,), "shared expert activation")
    gate_up = linear_producing(act.args[0], "shared expert gate/up projection")
    for lin, what in ((down, "down"), (gate_up, "gate/up")):
        expect_constant_params(lin, f"shared expert {what} projection")
        expect(lin.bias is None, f"shared expert {what} projection has a bias", lin.bias)
    for lin in (gate_up, gate) if gate else (gate_up,):
        expect(through_views(lin.x2d) is through_views(x), "shared expert reads another input", lin.x2d)
    return SharedExpert(total, gate_up, down, gate)


class FuseMoe(PatternPass):
    name = "fuse_moe"
    summary = "router softmax/top-k, sorted grouped SwiGLU experts, weighted sum (+ shared expert) -> graphopt.moe"
    requires = ("fuse_gated_mlp",)  # experts' and shared expert's activation is graphopt.swiglu by then
    # The sum over k is where a fusable block ends; a router topk is watched only to name an
    # expert loop (index_add_) that did not reach this graph whole.
    anchors = (aten.topk.default, aten.sum.dim_IntList, aten.index_add.default)

    def screen(self, combine: fx.Node) -> str | None:
        if is_op(combine, aten.topk.default):
            if not is_op(strip_casts(combine.args[0]), *SOFTMAX_OPS):
                return "a top-k that is no router's (no softmax in front)"
            if expert_loop_miss(combine) is None:
                return "router top-k of a block that ends in a sum over k (matched from there)"
            return None
        if is_op(combine, aten.index_add.default):
            if any(is_op(u, aten.index_add.default) and u.args[0] is combine for u in combine.users):
                return "not the last index_add of an expert loop (matched from the last)"
            if not any(is_op(n, aten.nonzero.default) for n in upstream(combine, 4)):
                return "an index_add that is no expert loop's (no nonzero of an expert mask in front)"
            return None
        source = combine.args[0]
        if not (is_op(source, *VIEW_OPS) and val(source) is not None and val(source).dim() == 3
                and list(combine.args[1]) == [1]):
            return "not a sum over the k axis of [tokens, k, hidden]"
        if not any(is_op(strip_casts(n), *grouped_mm_targets()) for n in upstream(source, 4)):
            return "no grouped GEMM in front of the sum"
        return None

    def match(self, combine: fx.Node, options) -> MoeMatch:
        if is_op(combine, aten.topk.default):
            raise NoMatch(expert_loop_miss(combine), combine)
        if is_op(combine, aten.index_add.default):
            return moe_via_index_add_loop(combine)  # no shared expert beside this spelling's loop
        m = moe_via_grouped_mm(combine)
        out = combine
        while len(out.users) == 1 and is_cast(next(iter(out.users))):
            out = next(iter(out.users))  # the cast back to x's dtype
        if len(out.users) == 1 and is_op(next(iter(out.users)), aten.add.Tensor):
            try:
                m.shared = shared_expert(next(iter(out.users)), out, m.x)
            except NoMatch as miss:  # the routed part still fuses; say why the add stayed outside
                m.left_out.append((next(iter(out.users)).name, f"shared expert left outside: {miss.reason}"))
        m.out = m.shared.total if m.shared else out
        return m

    def rewrite(self, gm: fx.GraphModule, m: MoeMatch, options) -> None:
        graph = gm.graph
        with graph.inserting_before(m.out):
            if isinstance(m, LoopMatch):  # per-expert matrices stacked into the op's [E, ...] weights
                name = str(m.routing.router.weight.target).removesuffix("_weight").removesuffix("_gate")
                gate_up = ir.add_constant(gm, name + "_experts_gate_up", torch.stack(m.gate_up_parts))
                down = ir.add_constant(gm, name + "_experts_down", torch.stack(m.down_parts))
            else:
                gate_up, down = _nn_layout(gm, m.gate_up), _nn_layout(gm, m.down)
            args = [m.x, m.routing.router.weight, gate_up, down, m.routing.k, m.routing.normalize]
            if m.shared:
                args += [m.shared.gate_up.weight, m.shared.down.weight, m.shared.gate.weight if m.shared.gate else None]
            fused = graph.call_function(graphopt.moe.default, tuple(args))
        m.out.replace_all_uses_with(fused)
        for node in getattr(m, "dropped", ()):  # checks of the loop's sizes: the loop is gone
            graph.erase_node(node)


def _nn_layout(gm: fx.GraphModule, weight_and_layout: tuple[fx.Node, bool]) -> fx.Node:
    """The weight as [E, out, in]: itself, or a transposed frozen copy of an [E, in, out] one."""
    weight, stored_transposed = weight_and_layout
    if not stored_transposed:
        return weight
    tensor = ir.get_constant(weight).transpose(1, 2).contiguous()
    with gm.graph.inserting_after(weight):
        return ir.add_constant(gm, str(weight.target) + "_nn_layout", tensor)


fuse_moe = FuseMoe()
