"""Drop identity ops: ``alias(x)``, ``view(x, x.shape)``, ``x[:]`` (a slice from 0 with step 1
that keeps the size), ``x * 1``, ``x / 1``, ``x + 0``, ``x - 0``, a cast to x's own dtype  ->  ``x``.

Why: models write these (Hugging Face scales rotary cos/sin by an ``attention_scaling``
of 1.0, adds 0 to position offsets; a DTensor layer views each projection's input to its
own shape, so q, k and v read three views and merge_qkv sees three inputs; ``x[:, :, None]``
slices the batch axis whole, which the tracer drops only when the batch is a static size) and
each one splits a pattern a fusion pass looks for, or makes a dynamic graph differ from its
static twin. Precondition: the op must not change dtype,
shape or device, and its value must not be a graph output (returning an input would make
an output alias it).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from graphopt.rewrite import IDENTITY_OPERAND, NoMatch, PatternPass, expect, is_cast, replace_uses, scalar, val

aten = torch.ops.aten


def _same_value_shape(a: fx.Node, b: fx.Node) -> bool:
    """Same dtype, device and shape, the sizes compared without a guard: ``==`` on symbolic
    sizes would add a shape guard (or raise on a data-dependent size, as in an expert loop),
    so only sizes known equal for every value of their symbols count."""
    va, vb = val(a), val(b)
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)
            and va.dtype == vb.dtype and va.device == vb.device and va.dim() == vb.dim()
            and all(statically_known_true(x == y) for x, y in zip(va.shape, vb.shape)))


class Canonicalize(PatternPass):
    name = "canonicalize"
    summary = "drop identity ops (alias, same-shape views, whole slices, x*1, x+0, same-dtype casts)"
    anchors = (aten.alias.default, aten.view.default, aten.slice.Tensor, aten._to_copy.default, *IDENTITY_OPERAND)
    record_near_misses = False

    def match(self, node: fx.Node, options) -> fx.Node:
        expect(all(u.op != "output" for u in node.users), "value is a graph output")
        source = node.args[0]
        if node.target in (aten.alias.default, aten.view.default):
            pass  # a view is an identity only when the shape check below holds
        elif node.target is aten.slice.Tensor:
            start = node.args[2] if len(node.args) > 2 else node.kwargs.get("start", 0)
            step = node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)
            # type() first: comparing a SymInt start would add a shape guard
            expect((start is None or type(start) is int and start == 0) and type(step) is int and step == 1,
                   "slice does not start at 0 with step 1")
        elif node.target is aten._to_copy.default:
            expect(is_cast(node), "cast changes more than the dtype")
        else:
            identity = IDENTITY_OPERAND[node.target]
            other = node.args[1] if len(node.args) > 1 else node.kwargs.get("other")
            expect(scalar(other) == identity and "alpha" not in node.kwargs, "not an identity constant")
        if not isinstance(source, fx.Node) or not _same_value_shape(source, node):
            raise NoMatch("changes dtype, shape or device", node)
        return node

    def rewrite(self, gm: fx.GraphModule, node: fx.Node, options) -> None:
        replace_uses(node, node.args[0])


canonicalize = Canonicalize()
