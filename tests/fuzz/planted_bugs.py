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
