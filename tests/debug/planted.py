"""Passes that are wrong on purpose, planted into the registry by the debug tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from graphopt.pass_manager import NoOptions, PassResult
from graphopt.rewrite import PatternPass, expect

RMS_NORM = torch.ops.graphopt.rms_norm.default


class RewriteEps(PatternPass):
    """Re-emits every graphopt.rms_norm (a counted, harmless rewrite), but gives the
    ``wrong``-th one (0-based, in graph order) eps = 1.0: a numeric bug in one rewrite."""

    name = "rewrite_eps"
    summary = "re-emit rms_norm; one of them with a wrong eps (tests)"
    anchors = (RMS_NORM,)

    def __init__(self, wrong: int = 2):
        self.wrong = wrong
        self.seen = 0
        self.wrong_anchor: str | None = None  # the node it broke, for the test to compare

    def candidates(self, gm):
        self.seen = 0
        return super().candidates(gm)

    def match(self, node: fx.Node, options) -> fx.Node:
        expect(node.meta.get("graphopt_pass") != self.name, "already re-emitted")
        return node

    def rewrite(self, gm: fx.GraphModule, node: fx.Node, options) -> None:
        x, weight, eps, *rest = node.args
        if self.seen == self.wrong:
            eps, self.wrong_anchor = 1.0, node.name
        self.seen += 1
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(RMS_NORM, (x, weight, eps, *rest))
        node.replace_all_uses_with(new)


@dataclass
class Explode:
    """Raises half-way through, after damaging its copy of the graph."""

    name: str = "explode"
    summary: str = "raises on purpose (tests)"
    Options: type = NoOptions
    requires: tuple = ()

    def run(self, gm, ctx):
        for node in gm.graph.nodes:
            if node.op == "call_function":
                node.args = ()
                break
        raise RuntimeError("boom: planted failure")


@dataclass
class DropsVal:
    """Forgets meta['val'] on the first rms_norm: fails verification, not by raising."""

    name: str = "drops_val"
    summary: str = "breaks verification on purpose (tests)"
    Options: type = NoOptions
    requires: tuple = ()

    def run(self, gm, ctx):
        node = next(n for n in gm.graph.nodes if n.target is RMS_NORM)
        del node.meta["val"]
        return PassResult(gm, modified=True, stats={"matches": 1})
