"""Passes that miscompile on purpose, for the tests that check the fuzzer catches them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from graphopt.pass_manager import PassResult
from graphopt.rewrite import NoMatch, PatternPass, call_args, expect

RMS_NORM = torch.ops.graphopt.rms_norm.default


class DropWeightOffset(PatternPass):
    """Re-emits every ``graphopt.rms_norm`` without its ``weight_offset``: wrong only for the
    Gemma spelling ``x * (1 + w)``, right for every other, like a real pass bug."""

    name = "drop_weight_offset"
    summary = "rms_norm(x, w, eps, offset) -> rms_norm(x, w, eps, 0) (a planted bug)"
    anchors = (RMS_NORM,)

    def match(self, node: fx.Node, options) -> fx.Node:
        expect(call_args(node)["weight_offset"] != 0.0, "no weight offset to drop")
        return node

    def rewrite(self, gm: fx.GraphModule, node: fx.Node, options) -> None:
        x, weight, eps = node.args[:3]
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(RMS_NORM, (x, weight, eps, 0.0))
        node.replace_all_uses_with(new)


class Fixed(PatternPass):
    """The same pass name with the bug fixed: it rewrites nothing."""

    name = "drop_weight_offset"
    summary = "fixed: leaves rms_norm alone"
    anchors = (RMS_NORM,)

    def match(self, node, options):
        raise NoMatch("fixed")


@dataclass
class NoOptions:
    pass


class BakeSizes:
    """Replaces every symbolic size the graph takes as an input with the size it had at
    compile time: right at that shape, wrong (a crash or a mismatch) at any other, like a
    pass or target that silently specializes a dynamic graph."""

    name = "bake_sizes"
    summary = "s0 -> 4 (a planted bug: specializes symbolic sizes)"
    Options = NoOptions
    requires: tuple[str, ...] = ()

    def run(self, gm: fx.GraphModule, ctx) -> PassResult:
        baked = 0
        for node in list(gm.graph.nodes):
            val = node.meta.get("val")
            if node.op == "placeholder" and isinstance(val, torch.SymInt) and node.users:
                node.replace_all_uses_with(int(val.node.hint))
                baked += 1
        gm.recompile()
        return PassResult(gm, bool(baked), {"matches": baked})


TOPK = torch.ops.aten.topk.default


class BreakTiesHigh(PatternPass):
    """Picks the top k of the last axis flipped and maps the indices back: the same choice
    as eager except at an exact tie, which goes to the higher-numbered expert, as a router
    that rounds its scores differently from eager may send it. Not a bug: a routing tie."""

    name = "break_ties_high"
    summary = "topk(x) -> topk(flip(x)) with indices mapped back (a planted tie-break)"
    anchors = (TOPK,)

    def match(self, node: fx.Node, options) -> fx.Node:
        x, dim = node.args[0], node.args[2] if len(node.args) > 2 else -1
        expect(dim in (-1, x.meta["val"].dim() - 1), "not the last axis")
        return node

    def rewrite(self, gm: fx.GraphModule, node: fx.Node, options) -> None:
        x = node.args[0]
        last = x.meta["val"].shape[-1] - 1
        with gm.graph.inserting_before(node):
            flipped = gm.graph.call_function(torch.ops.aten.flip.default, (x, [-1]))
            new = gm.graph.call_function(TOPK, (flipped, *node.args[1:]), dict(node.kwargs))
        node.replace_all_uses_with(new)
        for user in [u for u in new.users if u.args[1] == 1]:  # the indices: count from the other end again
            with gm.graph.inserting_after(user):
                back = gm.graph.call_function(torch.ops.aten.rsub.Scalar, (user, last))
            user.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back)
        gm.graph.erase_node(node)
