"""fuse_moe's second spelling, ``moe_via_index_add_loop``: transformers 4.x's loop over
experts captured whole (a chain of ``index_add`` from ``zeros``, one link per expert; see
``passes/fuse_moe.py``), and the near miss at a router ``topk`` whose loop did not reach
the graph whole (transformers 5.x's ``for expert in nonzero(hit)``).

A helper of one pass (``passes/fuse_moe.py``), not a pass.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.passes._moe_routing import (
    MoeMatch, call_of_output, downstream, grouped_mm_targets, match_routing, through_views,
)
from graphopt.rewrite import (
    MUL_OPS, RUNTIME_ASSERT_OPS, VIEW_OPS, commuted, expect, expect_op, is_op, strip_casts, val,
)
from graphopt.rewrite.linears import linear_producing

aten = torch.ops.aten
graphopt = torch.ops.graphopt


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
        unbind = call_of_output(token, 1, (aten.unbind.int,), f"expert {e}'s token ids")
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
        slot = call_of_output(scale.args[1][1], 0, (aten.unbind.int,), f"expert {e}'s slots")
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
        expect(x in (None, through_views(source_x)), "the experts read different inputs", gather)
        x = through_views(source_x)
        gate_up.append(gu)
        down.append(dn)
    ids, classes = _expert_ids_of_mask(mask)
    expect(len(links) == classes, f"the loop adds {len(links)} experts, the expert mask has {classes}", last)
    routing = match_routing(strip_casts(weights), ids)
    experts = val(routing.router.weight).shape[0]
    expect(classes == experts, f"the expert mask has {classes} experts, the router {experts}", mask)
    expect(x is through_views(routing.router.x2d), "router and experts read different inputs", x)
    dropped = [n for n in downstream([ids, *nonzeros], 4) if is_op(n, *RUNTIME_ASSERT_OPS)]
    return LoopMatch(last, routing.router.x2d, routing, (None, False), (None, False), gate_up_parts=gate_up,
                     down_parts=down, dropped=dropped)


GROUPED_MM_HINT = ("load the model with experts_implementation='grouped_mm' (transformers' default under "
                   "torch.compile), the spelling fuse_moe fuses")


def expert_loop_miss(topk: fx.Node) -> str | None:
    """Why a router ``topk`` heads an expert loop fuse_moe cannot fuse, or None: its expert ids
    leave the graph with no expert in it (the experts run in other graphs), or feed a
    ``nonzero`` / ``index_add`` loop captured whole."""
    ids = [u for u in topk.users if is_op(u, operator.getitem) and u.args[1] == 1]
    below = downstream(ids, 12)
    if any(is_op(n, *grouped_mm_targets()) for n in below):
        return None  # the grouped_mm spelling: the sum over k anchors it
    if not any(is_op(n, aten.index_add.default) for n in below) and any(n.op == "output" for n in below):
        return ("router top-k's expert ids leave the graph, so the experts run in other graphs: transformers' "
                "eager experts loop (for expert in expert_hit: ... index_add_) breaks dynamo's graph, its trip "
                "count depends on the routing; " + GROUPED_MM_HINT)
    if any(is_op(n, aten.nonzero.default) for n in below) and not any(is_op(n, aten.index_add.default) for n in below):
        return ("expert loop over nonzero(expert mask) with no index_add_ into an output is not a spelling "
                "fuse_moe matches; " + GROUPED_MM_HINT)
    return None  # a captured index_add_ loop: its last index_add anchors it
