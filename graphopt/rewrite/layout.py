"""Keeping a rewritten graph's memory layouts what the replaced values had."""

from __future__ import annotations

import torch
import torch.fx as fx

from torch.fx.experimental.symbolic_shapes import statically_known_true

from graphopt import ir
from graphopt.rewrite.match import val

aten = torch.ops.aten


def replace_uses(old: fx.Node, new: fx.Node) -> None:
    """Point every user of ``old`` at ``new`` (``old`` dies in dead-code elimination)."""
    old.replace_all_uses_with(new)


def restride_like(graph: fx.Graph, node: fx.Node, like: fx.Node) -> fx.Node:
    """``node``, or a copy of it laid out in memory as ``like`` is (same strides).

    ATen graphs from aot_autograd bake strides in: a ``view`` downstream was only legal for
    the layout the replaced value had, and some kernels (SDPA on the CPU) pick their
    output layout from their input's. So a fused op whose output is contiguous replaces
    a permuted value through ``permute -> clone -> permute back``, which a later pass that
    knows its consumer ignores strides may drop. Call inside an ``inserting_*`` context.
    """
    ir.infer_val(node)
    have, want = val(node), val(like)
    order = _dense_order(want)
    if _same_layout(have, want) or order is None:
        return node
    if order != list(range(want.dim())):
        node = graph.call_function(aten.permute.default, (node, order))
        ir.infer_val(node)
    node = graph.call_function(aten.clone.default, (node,), {"memory_format": torch.contiguous_format})
    ir.infer_val(node)
    if order != list(range(want.dim())):
        node = graph.call_function(aten.permute.default, (node, [order.index(d) for d in range(want.dim())]))
        ir.infer_val(node)
    return node


# Sizes here may be symbolic. Comparing them with ``==`` would add a shape guard to dynamo's
# graph (a size that might be 1 becomes "must not be 1": a recompile for batch 1), so every
# test is "provably true for all sizes", and an undecided one takes the conservative branch.


def _dense_order(t: torch.Tensor) -> list[int] | None:
    """The dims of ``t`` from outermost to innermost in memory, if it is a permuted dense tensor."""
    order = sorted(range(t.dim()), key=lambda d: (-_hint(t.stride()[d]), d))
    expected = 1
    for d in reversed(order):
        if not _known(t.shape[d] == 1) and not _known(t.stride()[d] == expected):
            return None
        expected *= t.shape[d]
    return order


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dim() == b.dim() and all(_known(x == y) for x, y in zip(a.shape, b.shape)) and all(
        _known(sa == sb) for sa, sb, n in zip(a.stride(), b.stride(), a.shape) if not _known(n == 1))


def _known(condition) -> bool:
    """True when ``condition`` holds for every value of its symbols; never adds a guard."""
    return statically_known_true(condition)


def _hint(size) -> int:
    """A size's value in the example inputs (ordering only; nothing is specialised on it)."""
    return size.node.hint if isinstance(size, torch.SymInt) and size.node.has_hint() else int(size)
