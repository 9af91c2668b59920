"""fuse_moe's shared parts: the router both MoE spellings end in (``softmax(x @ Wr^T) ->
topk [-> w / sum w]``), the match records, and the short walks over views, producers and
readers both matchers take.

A helper of one pass (``passes/fuse_moe.py``), not a pass.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from graphopt.rewrite import DIV_OPS, SOFTMAX_OPS, VIEW_OPS, call_args, expect, expect_op, is_op, strip_casts
from graphopt.rewrite.linears import Linear, expect_constant_params, linear_producing

aten = torch.ops.aten


def grouped_mm_targets() -> tuple:
    """The grouped GEMM overloads a captured graph may hold: aten's (bf16 on GPUs) and
    transformers' fallback custom op (every other dtype), when transformers is loaded."""
    targets = [aten._grouped_mm.default]
    try:
        targets.append(torch.ops.transformers.grouped_mm_fallback.default)
    except (AttributeError, RuntimeError):  # transformers not imported: no graph can hold its op
        pass
    return tuple(targets)


def through_views(node):
    while is_op(node, *VIEW_OPS):
        node = node.args[0]
    return node


def call_of_output(node, index: int, producer_targets: tuple, what: str) -> fx.Node:
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


def match_routing(weights: fx.Node, ids: fx.Node) -> Routing:
    """topk(softmax(x @ Wr^T), k): ``weights`` the (maybe renormalised) values, ``ids`` the indices."""
    topk = call_of_output(ids, 1, (aten.topk.default,), "expert ids")
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


def upstream(node: fx.Node, depth: int) -> list[fx.Node]:
    """Nodes up to ``depth`` edges above ``node``."""
    seen, frontier = [], [node]
    for _ in range(depth):
        frontier = [a for n in frontier for a in n.all_input_nodes]
        seen += frontier
    return seen


def downstream(nodes: list[fx.Node], depth: int) -> set[fx.Node]:
    """Nodes (the output node included) up to ``depth`` edges below ``nodes``."""
    seen, frontier = set(), list(nodes)
    for _ in range(depth):
        frontier = [u for n in frontier for u in n.users if u not in seen]
        seen.update(frontier)
    return seen
