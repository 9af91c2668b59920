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
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.linears import Linear, expect_constant_params, linear_producing
from graphopt.rewrite import (
    DIV_OPS, MUL_OPS, RUNTIME_ASSERT_OPS, SOFTMAX_OPS, VIEW_OPS, NoMatch, PatternPass, call_args, commuted, expect,
    expect_op, is_cast, is_op, strip_casts, val,
)

aten = torch.ops.aten
graphopt = torch.ops.graphopt


def _grouped_mm_targets() -> tuple:
    """The grouped GEMM overloads a captured graph may hold: aten's (bf16 on GPUs) and
    transformers' fallback custom op (every other dtype), when transformers is loaded."""
    targets = [aten._grouped_mm.default]
    try:
        targets.append(torch.ops.transformers.grouped_mm_fallback.default)
    except (AttributeError, RuntimeError):  # transformers not imported: no graph can hold its op
        pass
    return tuple(targets)


def _through_views(node):
    while is_op(node, *VIEW_OPS):
        node = node.args[0]
    return node


def _getitem(node, index: int, producer_targets: tuple, what: str) -> fx.Node:
    """``node`` is output ``index`` of a call to one of ``producer_targets``; returns that call."""
    expect(is_op(node, operator.getitem) and node.args[1] == index, f"{what} is not output {index} of a call", node)
    return expect_op(node.args[0], producer_targets, what)


@dataclass
class Routing:
    topk: fx.Node
    router: Linear
    k: int
    normalize: bool


@dataclass
class SharedExpert:
    total: fx.Node  # the add of routed and shared outputs: what the fused op replaces
    gate_up: Linear
    down: Linear
    gate: Linear | None


@dataclass
class MoeMatch:
    out: fx.Node  # the value graphopt.moe replaces
    x: fx.Node  # [tokens, hidden]
    routing: Routing
    gate_up: tuple[fx.Node, bool]  # frozen weight, and whether it is stored [E, in, out]
    down: tuple[fx.Node, bool]
    shared: SharedExpert | None = None
    left_out: list = field(default_factory=list)


def _routing(weights: fx.Node, ids: fx.Node) -> Routing:
    """topk(softmax(x @ Wr^T), k): ``weights`` the (maybe renormalised) values, ``ids`` the indices."""
    topk = _getitem(ids, 1, (aten.topk.default,), "expert ids")
    weights = strip_casts(weights)
    normalize = is_op(weights, *DIV_OPS)
    if normalize:  # w / w.sum(-1, keepdim=True)
        values, total = weights.args[:2]
        expect(is_op(total, aten.sum.dim_IntList) and total.args[0] is values and list(total.args[1]) in ([-1], [1])
               and (total.args[2] if len(total.args) > 2 else total.kwargs.get("keepdim", False)),
               "routing weights are divided by something other than their sum over k", total)
        weights = values
    expect(is_op(weights, operator.getitem) and weights.args[0] is topk and weights.args[1] == 0,
           "routing weights are not the top-k values of the same topk as the expert ids", weights)
    args = call_args(topk)
    expect(args["dim"] in (-1, 1) and args["largest"], "topk is not the largest k over the expert axis", topk)
    probs = strip_casts(args["self"])
    expect_op(probs, SOFTMAX_OPS, "router probabilities")
    expect(probs.args[1] in (-1, 1), "router softmax is not over the expert axis", probs)
    logits = strip_casts(probs.args[0])
    router = linear_producing(logits, "router")
    expect_constant_params(router, "router")
    expect(router.bias is None, "router has a bias (graphopt.moe has none)", router.bias)
    return Routing(topk, router, int(args["k"]), normalize)


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
    expect_op(node, _grouped_mm_targets(), what)
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
    expect(is_op(_through_views(inv_perm.args[2]), aten.arange.default, aten.arange.start),
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

    sort = _getitem(perm_node, 1, (aten.sort.default, aten.sort.stable), "token permutation")
    ids = _through_views(sort.args[0])
    routing = _routing(_through_views(sorted_w.args[0]), ids)
    k = routing.k
    _check_offsets(offsets, sort, val(routing.router.weight).shape[0])

    gathered = expect_op(hidden_up, (aten.index.Tensor,), "tokens gathered in expert order")
    token_of = gathered.args[1][0]
    expect(is_op(token_of, aten.floor_divide.default, aten.div.Tensor_mode) and token_of.args[0] is perm_node
           and token_of.args[1] == k, f"tokens are not gathered with perm // {k}", token_of)
    x = gathered.args[0]
    expect(_through_views(x) is _through_views(routing.router.x2d) and val(x).dim() == 2,
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
        expect(_through_views(lin.x2d) is _through_views(x), "shared expert reads another input", lin.x2d)
    return SharedExpert(total, gate_up, down, gate)


# --- the loop over experts with index_add_ (transformers 4.x Mixtral / Qwen2-MoE) ------------


@dataclass
class LoopMatch(MoeMatch):
    gate_up_parts: list = field(default_factory=list)  # per expert: [2 * inter, hidden] tensor
    down_parts: list = field(default_factory=list)  # per expert: [hidden, inter] tensor
    dropped: list = field(default_factory=list)  # runtime asserts of the loop's data-dependent sizes


def _expert_matrix(node: fx.Node, what: str) -> torch.Tensor:
    """A frozen 2-D weight: a constant, or ``select(constant, 0, e)`` of a 3-D one."""
    if is_op(node, aten.select.int) and node.args[1] == 0 and ir.get_constant(node.args[0]) is not None:
        return ir.get_constant(node.args[0])[node.args[2]]
    tensor = ir.get_constant(node)
    expect(tensor is not None, f"{what} weight is not a constant (freeze_weights=False?)", node)
    return tensor


def _expert_mlp(out: fx.Node, e: int) -> tuple[fx.Node, torch.Tensor, torch.Tensor]:
    """(rows it reads, [W_gate; W_up], W_down) of ``down(silu(x @ Wg^T) * (x @ Wu^T))``, or of
    ``down(graphopt.swiglu(x @ [Wg; Wu]^T))`` once fuse_gated_mlp has run."""
    down = linear_producing(out, f"expert {e} down projection")
    expect(down.bias is None, f"expert {e} down projection has a bias", down.bias)
    act = down.x2d
    if is_op(act, graphopt.swiglu.default):
        gate_up = linear_producing(act.args[0], f"expert {e} gate/up projection")
        expect(gate_up.bias is None, f"expert {e} gate/up projection has a bias", gate_up.bias)
        return (gate_up.x2d, _expert_matrix(gate_up.weight, f"expert {e} gate/up"),
                _expert_matrix(down.weight, f"expert {e} down"))
    expect_op(act, MUL_OPS, f"expert {e} activation (silu(gate) * up)")
    silu, up_out = commuted(act, lambda v: is_op(v, aten.silu.default), "silu of the gate projection")
    gate = linear_producing(silu.args[0], f"expert {e} gate projection")
    up = linear_producing(up_out, f"expert {e} up projection")
    expect(gate.bias is None and up.bias is None, f"expert {e} gate or up projection has a bias", gate.gemm)
    expect(gate.x2d is up.x2d, f"expert {e} gate and up projections read different rows", up.x2d)
    weights = [_expert_matrix(lin.weight, f"expert {e} {w}") for lin, w in ((gate, "gate"), (up, "up"))]
    return gate.x2d, torch.cat(weights), _expert_matrix(down.weight, f"expert {e} down")


def _expert_ids_of_mask(mask: fx.Node) -> tuple[fx.Node, int]:
    """``one_hot(ids, experts).permute(2, 1, 0)`` as aot writes it: ``_to_copy(eq(unsqueeze(ids,
    -1), arange(experts)), int64)`` permuted; returns ``(ids, experts)``."""
    expect(is_op(mask, aten.permute.default) and list(mask.args[1]) == [2, 1, 0],
           "expert mask is not one_hot(ids).permute(2, 1, 0)", mask)
    eq = strip_casts(mask.args[0])
    expect_op(eq, (aten.eq.Tensor,), "expert mask (one_hot's comparison with an arange)")
    ids, arange = eq.args[0], eq.args[1]
    expect(is_op(arange, aten.arange.default) and isinstance(arange.args[0], int),
           "expert mask does not compare the ids with arange(experts)", arange)
    expect(is_op(ids, aten.unsqueeze.default) and ids.args[1] in (-1, 2), "expert mask does not unsqueeze the ids", ids)
    return ids.args[0], arange.args[0]


def moe_via_index_add_loop(last: fx.Node) -> LoopMatch:
    """Match ``zeros -> index_add(0, token_e, expert_e(x[token_e]) * w[token_e, slot_e]) -> ...``
    over every expert e, ``slot_e, token_e = where(mask[e])``, back to the router."""
    links, acc = [], last
    while is_op(acc, aten.index_add.default):
        links.append(acc)
        acc = acc.args[0]
    links.reverse()
    expect_op(acc, (aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default), "expert loop accumulator")
    mask, weights, x, gate_up, down, nonzeros = None, None, None, [], [], []
    for e, link in enumerate(links):
        expect(link.args[1] == 0 and all(len(u.args) > 0 for u in link.users),
               f"expert {e}'s index_add is not along the token axis", link)
        expect(link is last or len(link.users) == 1, f"expert {e}'s partial sum has other readers", link)
        token = link.args[2]
        unbind = _getitem(token, 1, (aten.unbind.int,), f"expert {e}'s token ids")
        nonzero = expect_op(unbind.args[0], (aten.nonzero.default,), f"expert {e}'s (slot, token) pairs")
        row = expect_op(nonzero.args[0], (aten.select.int,), f"expert {e}'s mask row")
        expect(row.args[1] == 0 and row.args[2] == e, f"index_add {e} reads the mask row of expert {row.args[2]}", row)
        expect(mask in (None, row.args[0]), "the experts read different masks", row)
        mask = row.args[0]
        nonzeros.append(nonzero)
        weighted = strip_casts(link.args[3])
        expect_op(weighted, MUL_OPS, f"expert {e}'s weighted output")
        scale, expert_out = commuted(weighted, lambda v: is_op(v, aten.index.Tensor), "a gathered routing weight")
        expect(len(scale.args[1]) == 2 and scale.args[1][0] is token, f"expert {e}'s weight is not w[token, slot]", scale)
        slot = _getitem(scale.args[1][1], 0, (aten.unbind.int,), f"expert {e}'s slots")
        expect(slot is unbind, f"expert {e}'s weight is not w[token, slot] of its own mask row", scale)
        source = scale.args[0]
        source = source.args[0] if is_op(source, aten.unsqueeze.default) else source
        expect(weights in (None, source), "the experts read different routing weights", scale)
        weights = source
        rows, gu, dn = _expert_mlp(strip_casts(expert_out), e)
        gather = rows.args[0] if is_op(rows, *VIEW_OPS) else rows
        expect_op(gather, (aten.index.Tensor,), f"expert {e}'s rows (x[token])")
        indices = [i for i in gather.args[1] if i is not None]
        expect(indices == [token], f"expert {e} gathers rows other than its own tokens", gather)
        source_x = gather.args[0].args[0] if is_op(gather.args[0], aten.unsqueeze.default) else gather.args[0]
        expect(x in (None, _through_views(source_x)), "the experts read different inputs", gather)
        x = _through_views(source_x)
        gate_up.append(gu)
        down.append(dn)
    ids, classes = _expert_ids_of_mask(mask)
    expect(len(links) == classes, f"the loop adds {len(links)} experts, the expert mask has {classes}", last)
    routing = _routing(strip_casts(weights), ids)
    experts = val(routing.router.weight).shape[0]
    expect(classes == experts, f"the expert mask has {classes} experts, the router {experts}", mask)
    expect(x is _through_views(routing.router.x2d), "router and experts read different inputs", x)
    dropped = [n for n in _downstream([ids, *nonzeros], 4) if is_op(n, *RUNTIME_ASSERT_OPS)]
    return LoopMatch(last, routing.router.x2d, routing, (None, False), (None, False), gate_up_parts=gate_up,
                     down_parts=down, dropped=dropped)


GROUPED_MM_HINT = ("load the model with experts_implementation='grouped_mm' (transformers' default under "
                   "torch.compile), the spelling fuse_moe fuses")


def expert_loop_miss(topk: fx.Node) -> str | None:
    """Why a router ``topk`` heads an expert loop fuse_moe cannot fuse, or None: its expert ids
    leave the graph with no expert in it (the experts run in other graphs), or feed a
    ``nonzero`` / ``index_add`` loop captured whole."""
    ids = [u for u in topk.users if is_op(u, operator.getitem) and u.args[1] == 1]
    below = _downstream(ids, 12)
    if any(is_op(n, *_grouped_mm_targets()) for n in below):
        return None  # the grouped_mm spelling: the sum over k anchors it
    if not any(is_op(n, aten.index_add.default) for n in below) and any(n.op == "output" for n in below):
        return ("router top-k's expert ids leave the graph, so the experts run in other graphs: transformers' "
                "eager experts loop (for expert in expert_hit: ... index_add_) breaks dynamo's graph, its trip "
                "count depends on the routing; " + GROUPED_MM_HINT)
    if any(is_op(n, aten.nonzero.default) for n in below) and not any(is_op(n, aten.index_add.default) for n in below):
        return ("expert loop over nonzero(expert mask) with no index_add_ into an output is not a spelling "
                "fuse_moe matches; " + GROUPED_MM_HINT)
    return None  # a captured index_add_ loop: its last index_add anchors it


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
            if not any(is_op(n, aten.nonzero.default) for n in _upstream(combine, 4)):
                return "an index_add that is no expert loop's (no nonzero of an expert mask in front)"
            return None
        source = combine.args[0]
        if not (is_op(source, *VIEW_OPS) and val(source) is not None and val(source).dim() == 3
                and list(combine.args[1]) == [1]):
            return "not a sum over the k axis of [tokens, k, hidden]"
        if not any(is_op(strip_casts(n), *_grouped_mm_targets()) for n in _upstream(source, 4)):
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


def _upstream(node: fx.Node, depth: int) -> list[fx.Node]:
    """Nodes up to ``depth`` edges above ``node``."""
    seen, frontier = [], [node]
    for _ in range(depth):
        frontier = [a for n in frontier for a in n.all_input_nodes]
        seen += frontier
    return seen


def _downstream(nodes: list[fx.Node], depth: int) -> set[fx.Node]:
    """Nodes (the output node included) up to ``depth`` edges below ``nodes``."""
    seen, frontier = set(), list(nodes)
    for _ in range(depth):
        frontier = [u for n in frontier for u in n.users if u not in seen]
        seen.update(frontier)
    return seen


def _nn_layout(gm: fx.GraphModule, weight_and_layout: tuple[fx.Node, bool]) -> fx.Node:
    """The weight as [E, out, in]: itself, or a transposed frozen copy of an [E, in, out] one."""
    weight, stored_transposed = weight_and_layout
    if not stored_transposed:
        return weight
    tensor = ir.get_constant(weight).transpose(1, 2).contiguous()
    with gm.graph.inserting_after(weight):
        return ir.add_constant(gm, str(weight.target) + "_nn_layout", tensor)


fuse_moe = FuseMoe()
