"""Residual add + RMSNorm: ``s = a + b; y = graphopt.rms_norm(s, w, eps)  ->
y, s = graphopt.add_rms_norm(a, b, w, eps)``.

Why: in a pre-norm transformer every norm but the first reads ``residual + branch``, and
the sum is also the next residual. The fused op reads a and b once and writes y and s in
one pass over the row (a Triton kernel, ORT's SkipSimplifiedLayerNormalization) instead
of writing s and reading it back for the norm.

Runs after fuse_rms_norm and matches its ``graphopt.rms_norm`` node, so every RMSNorm
spelling that pass knows composes here. The other users of the sum (the residual stream)
read the op's second output.

Spellings matched: the norm reading the sum directly; the norm reading the sum through
exact upcasts (``s.float()``) when its result is cast back to the sum's dtype (Gemma's
``norm(x.float()) * (1 + w.float())`` then ``type_as(x)``, where fuse_rms_norm keeps the
cast because the weight multiply sits between the norm and the cast back).
Preconditions: a plain two-tensor ``aten.add`` (no alpha, no scalar); both operands have
the sum's shape and dtype (no broadcasting, no type promotion); no other user of the sum
sits before the point where the norm's weight is available.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.rewrite import (
    NoMatch, PatternPass, call_args, cast_back_user, cast_like, dtype_name, expect, is_cast, is_exact_upcast,
    match_residual_add, scalar, val,
)

aten = torch.ops.aten

@dataclass
class AddRmsNormMatch:
    add: fx.Node
    x: fx.Node
    residual: fx.Node
    weight: fx.Node | None
    eps: float
    weight_offset: float
    output: fx.Node  # the node whose value the op's first output replaces
    dying: set[fx.Node]  # the norm and the casts feeding it: dead once output is replaced
    after: fx.Node  # the fused op goes right after this node


def _read_through_upcasts(norm: fx.Node, x: Any) -> tuple[Any, fx.Node, list[fx.Node]]:
    """(the value the norm normalises before any cast, the node the fused op replaces,
    the casts between them). Casts are allowed only when they are exact upcasts and the
    norm's result is cast back to the source dtype: then the op's rounding of the
    normalised value to that dtype is what the model does anyway."""
    casts, source = [], x
    while is_cast(source):
        casts.append(source)
        source = source.args[0]
    if not casts:
        return source, norm, casts
    match_residual_add(source, "norm input (through a cast)")
    for cast in casts:
        src, dst = val(cast.args[0]).dtype, val(cast).dtype
        expect(is_exact_upcast(src, dst),
               f"norm reads the sum through a cast {dtype_name(src)} -> {dtype_name(dst)}; "
               "add_rms_norm would normalise the uncast sum", cast)
    low, high = val(source).dtype, val(x).dtype
    back = cast_back_user(norm, low)
    expect(back is not None,
           f"norm reads the sum upcast {dtype_name(low)} -> {dtype_name(high)} and its result is not cast "
           f"back; add_rms_norm would round the normalised sum to {dtype_name(low)}", norm)
    return source, back, casts


def _dying(norm: fx.Node, casts: list[fx.Node]) -> set[fx.Node]:
    """The norm and the casts that only feed it (walking up from the norm)."""
    dead = {norm}
    for cast in casts:
        if not set(cast.users) <= dead:
            break
        dead.add(cast)
    return dead


def _nodes_between(first: fx.Node, last: fx.Node) -> set[fx.Node]:
    """The nodes after ``first`` up to and including ``last`` in graph order."""
    found, node = set(), first.next
    while node is not last and node.op != "output":
        found.add(node)
        node = node.next
    return found | {last}


def _insertion_point(add: fx.Node, weight: Any, norm: fx.Node) -> fx.Node:
    """The add, or the weight when the weight is computed after the add (Gemma's
    ``w.float()``): the fused op needs both. Walks only the span from the add to the norm."""
    if not isinstance(weight, fx.Node):
        return add
    node = add.next
    while node is not norm:
        if node is weight:
            return weight
        node = node.next
    return add


class FuseAddRmsNorm(PatternPass):
    name = "fuse_add_rms_norm"
    summary = "s = a + b; graphopt.rms_norm(s) -> graphopt.add_rms_norm(a, b) returning (norm, s)"
    requires = ("fuse_rms_norm",)
    anchors = (torch.ops.graphopt.rms_norm.default,)

    def match(self, norm: fx.Node, options) -> AddRmsNormMatch:
        args = call_args(norm)
        source, output, casts = _read_through_upcasts(norm, args["x"])
        residual = match_residual_add(source, "norm input")
        add, a, b = residual.add, residual.a, residual.b

        dying = _dying(norm, casts)
        weight = args["weight"]
        after = _insertion_point(add, weight, norm)
        if after is not add:
            # the residual stream reads the fused op's second output: it must exist by then
            early = _nodes_between(add, after) & (set(add.users) - dying)
            if early:
                user = min(early, key=lambda n: n.name)
                raise NoMatch(f"sum {add.name} is read by {user.name} before the norm weight "
                              f"{after.name} is computed", user)
        eps = args["eps"]
        expect(scalar(eps) is not None, "eps is not a constant", norm)
        return AddRmsNormMatch(add, a, b, weight, scalar(eps), scalar(args["weight_offset"]) or 0.0,
                               output, dying, after)

    def rewrite(self, gm: fx.GraphModule, m: AddRmsNormMatch, options) -> None:
        graph = gm.graph
        residual_users = [u for u in m.add.users if u not in m.dying]
        # inserting_before(next) keeps the new nodes in creation order (inserting_after reverses them)
        with graph.inserting_before(m.after.next):
            fused = graph.call_function(
                torch.ops.graphopt.add_rms_norm.default, (m.x, m.residual, m.weight, m.eps, m.weight_offset))
            ir.infer_val(fused)  # cast_like below reads the getitem's value
            normed = graph.call_function(operator.getitem, (fused, 0))
            result = cast_like(gm, normed, m.output)
            total = graph.call_function(operator.getitem, (fused, 1)) if residual_users else None
        m.output.replace_all_uses_with(result)
        if total is not None:
            m.add.replace_all_uses_with(total, delete_user_cb=lambda user: user not in m.dying)


fuse_add_rms_norm = FuseAddRmsNorm()
