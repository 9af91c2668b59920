"""The base of one-pattern fusion passes (see the package docstring)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch.fx as fx

from graphopt import ir
from graphopt.pass_manager import NearMiss, NoOptions, PassContext, PassResult
from graphopt.rewrite.match import NoMatch

# Node metadata a rewrite carries from the node it replaces to the nodes it creates.
_INHERITED_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "seq_nr")


class PatternPass:
    """Base of one-pattern fusion passes. Subclasses set the class attributes and
    implement ``match`` and ``rewrite``."""

    name: ClassVar[str]
    summary: ClassVar[str]
    Options: ClassVar[type] = NoOptions
    requires: ClassVar[tuple[str, ...]] = ()
    anchors: ClassVar[tuple[Any, ...]] = ()
    # False for passes whose every anchor is a candidate (canonicalize): their misses are noise.
    record_near_misses: ClassVar[bool] = True

    def screen(self, anchor: fx.Node) -> str | None:
        """A cheap test before matching: why ``anchor`` is no candidate at all (``"no
        silu or gelu operand"``), or None to match it. Screened anchors are recorded as
        screened near misses, so ``graphopt debug --why`` can still say why a pass saw
        nothing, grouped by reason instead of one line per residual add."""
        return None

    def match(self, anchor: fx.Node, options: Any) -> Any:
        """Return a match object, or raise NoMatch(reason, node). A match object may carry
        ``left_out: list[(node name, reason)]``, recorded as near misses once it is rewritten."""
        raise NotImplementedError

    def rewrite(self, gm: fx.GraphModule, match: Any, options: Any) -> None:
        """Insert the fused node(s) and redirect the users of the matched value(s)."""
        raise NotImplementedError

    def candidates(self, gm: fx.GraphModule) -> list[fx.Node]:
        return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in self.anchors]

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        options = ctx.options_for(self)
        near_misses: list[NearMiss] = []
        matches = 0
        fake_mode = ir.fake_mode_of(gm)
        anchors = self.candidates(gm)
        read = {a for a in anchors if a.users}
        for anchor in anchors:
            if anchor.graph is not gm.graph or anchor._erased or (anchor in read and not anchor.users):
                continue  # consumed by an earlier rewrite in this pass (its readers moved to the fused op)
            dismissed = self.screen(anchor)
            if dismissed is not None:
                near_misses.append(NearMiss(self.name, anchor.name, anchor.name, dismissed, screened=True))
                continue
            try:
                found = self.match(anchor, options)
            except NoMatch as miss:
                if self.record_near_misses:
                    stop = miss.node.name if miss.node is not None else anchor.name
                    near_misses.append(NearMiss(self.name, anchor.name, stop, miss.reason))
                continue
            if not ctx.allow_rewrite(self.name, anchor):
                near_misses.append(NearMiss(self.name, anchor.name, anchor.name, "bisect limit reached"))
                continue
            existing = set(gm.graph.nodes)
            self.rewrite(gm, found, options)
            self._finish_new_nodes(gm, existing, anchor, fake_mode)
            matches += 1
            # What a match left out of the fused op (a residual add that stays outside) is a
            # near miss too; it travels on the match, so a pass keeps no state between runs.
            for node_name, reason in getattr(found, "left_out", ()):
                near_misses.append(NearMiss(self.name, anchor.name, node_name, reason))
        if matches:
            gm.graph.eliminate_dead_code()
            gm.recompile()
        return PassResult(gm, modified=matches > 0, stats={"matches": matches}, near_misses=near_misses)

    def _finish_new_nodes(self, gm: fx.GraphModule, existing: set, anchor: fx.Node, fake_mode) -> None:
        """Stamp new nodes with this pass, inherit the anchor's source info, infer meta['val']."""
        for node in gm.graph.nodes:
            if node in existing:
                continue
            node.meta.setdefault(ir.CREATED_BY, self.name)
            for key in _INHERITED_META:
                if key in anchor.meta:
                    node.meta.setdefault(key, anchor.meta[key])
            if "val" not in node.meta:
                ir.infer_val(node, fake_mode)
