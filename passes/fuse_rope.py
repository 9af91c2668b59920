"""Rotary embedding: ``x * cos + rotate(x) * sin  ->  graphopt.rope(x, cos, sin, interleaved)``.

Why: the decomposed form reads x three times (the cos product and the two slices of the
rotation) and writes five temporaries (slices, neg, cat or stack, two products); the fused
op reads x and the tables once (a Triton kernel, ORT's RotaryEmbedding).

Spellings matched:
- rotate-half, as transformers' ``rotate_half`` writes it: ``cat(-x[..., h:], x[..., :h])``;
- interleaved pairs, as GPT-J writes it: ``stack(-x[..., 1::2], x[..., ::2], -1).flatten(-2)``,
  or with the pairs taken by ``x.reshape(..., D/2, 2).unbind(-1)``;
- partial rotary (GPT-NeoX, Phi, GPT-J): the rope of ``x[..., :R]`` concatenated with the
  untouched ``x[..., R:]`` becomes one op on x with R-wide tables;
- x in [B, H, S, D] layout (cos/sin broadcast over dim 1) or [B, S, H, D] (broadcast over
  dim 2, as GPT-J's ``sin[:, :, None, :]``): the latter is transposed in and out of the op.
cos/sin of any shape that broadcasts that way ([S, R], [1, 1, S, R], ``unsqueeze(cos, 1)``
of [B, S, R] as transformers writes it) are brought to [B, S, R] with squeeze/expand nodes.

Preconditions: the rotation reads the tensor cos scales; the halves split at D/2 (pairs at
even/odd channels) with the minus sign on the second half (odd channel), which is the
rotation direction the op computes; cos/sin vary over neither the head axis nor more than
the R rotated channels; every fused intermediate has one user. Llama's ``cos * 1.0``
(attention_scaling) does not stop the match, but ``canonicalize`` first keeps it out of the
tables.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from graphopt import ir
from graphopt.rewrite import (
    VIEW_OPS, cast_like, expect, expect_op, is_cast, is_op, NoMatch, PatternPass, restride_like, scalar,
    single_use, val,
)

aten = torch.ops.aten



@dataclass
class RopeMatch:
    x: fx.Node  # the tensor whose first rot_dim channels rotate
    cos: fx.Node  # as found in the graph: broadcastable to x[..., :rot_dim]
    sin: fx.Node
    rot_dim: int
    interleaved: bool
    head_axis: int  # 1 for [B, H, S, D] (the op's layout), 2 for [B, S, H, D]
    output: fx.Node  # the add, or the partial-rotary cat


# ---------------------------------------------------------------- small structural helpers

def _last_axis(dim: int, node: fx.Node) -> bool:
    rank = val(node).dim()
    return dim in (-1, rank - 1)


def _slice(node: fx.Node) -> tuple[fx.Node, int, int, int, int]:
    """(source, dim, start, end, step) of ``aten.slice``, normalised against the source shape."""
    args = list(node.args) + [None] * (5 - len(node.args))
    src, dim, start, end, step = args[:5]
    dim = node.kwargs.get("dim", 0 if dim is None else dim)
    start = node.kwargs.get("start", 0 if start is None else start)
    end = node.kwargs.get("end", end)
    step = node.kwargs.get("step", 1 if step is None else step)
    size = val(src).shape[dim]
    end = size if end is None else end
    expect(all(isinstance(v, int) for v in (start, end, step, size)), f"{node.name} has symbolic bounds", node)
    start = start + size if start < 0 else start
    end = size if end >= size else (end + size if end < 0 else end)
    return src, dim % val(src).dim(), min(start, size), end, step


def _same_value(a, b, depth: int = 4) -> bool:
    """``a is b``, or the same view op with the same arguments of the same value (``q[..., :r]``
    written twice, which a graph without CSE keeps as two slices)."""
    if a is b:
        return True
    if depth == 0 or not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return False
    if a.op != "call_function" or a.target is not b.target or a.kwargs != b.kwargs or len(a.args) != len(b.args):
        return False
    if a.target not in (aten.slice.Tensor, aten.transpose.int, aten.permute.default, *VIEW_OPS):
        return False
    return _same_value(a.args[0], b.args[0], depth - 1) and list(a.args[1:]) == list(b.args[1:])


def _negated(node) -> fx.Node | None:
    """``y`` for ``-y`` written as ``neg(y)`` or ``y * -1``; else None."""
    if is_op(node, aten.neg.default):
        return node.args[0]
    if is_op(node, aten.mul.Tensor, aten.mul.Scalar) and scalar(node.args[1]) == -1.0:
        return node.args[0]
    return None


def _trig(node) -> str | None:
    """'cos' or 'sin' when ``node`` is a reshaped/cast/scaled aten.cos or aten.sin; else None."""
    for _ in range(12):
        if is_op(node, aten.cos.default):
            return "cos"
        if is_op(node, aten.sin.default):
            return "sin"
        if is_op(node, aten.mul.Tensor, aten.mul.Scalar) and scalar(node.args[1]) is not None:
            node = node.args[0]
        elif is_op(node, aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default, aten.clone.default,
                   aten.slice.Tensor, aten.index.Tensor, *VIEW_OPS) or is_cast(node):
            node = node.args[0]
        else:
            return None
    return None


# ---------------------------------------------------------------- the rotation

def _rotate_half_source(cat: fx.Node) -> fx.Node:
    """x for ``cat(-x[..., h:], x[..., :h], -1)`` with h = D/2."""
    tensors, dim = cat.args[0], cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    expect(len(tensors) == 2, f"rotate cat joins {len(tensors)} tensors, expected 2", cat)
    expect(_last_axis(dim, cat), f"rotate cat along dim {dim}, expected -1", cat)
    first, second = tensors
    if _negated(first) is None:
        expect(_negated(second) is None, "rotate negates the first half, cat(x2, -x1): the opposite "
               "rotation to rotate-half's cat(-x2, x1)", cat)
        raise NoMatch("rotate cat negates neither half", cat)
    neg = single_use(first, "rotate neg")
    high, low = _negated(neg), second
    expect_op(high, aten.slice.Tensor, "negated half")
    expect_op(low, aten.slice.Tensor, "kept half")
    src, dim_h, start_h, end_h, step_h = _slice(high)
    src_l, dim_l, start_l, end_l, step_l = _slice(low)
    expect(_same_value(src, src_l), "rotate halves slice different tensors", cat)
    expect(dim_h == dim_l == val(src).dim() - 1 and step_h == step_l == 1,
           "rotate halves are not contiguous slices of the last dim", cat)
    width = val(src).shape[-1]
    expect(start_h == end_l, f"halves split at {start_h} and {end_l}", cat)
    expect(start_h * 2 == width and start_l == 0 and end_h == width,
           f"halves split at {start_h}, expected {width // 2}", high)
    return src


def _pair_member(node: fx.Node) -> tuple[fx.Node, int]:
    """(x, 0 | 1) for the even or odd channels of x: ``x[..., i::2]`` or unbind/select of
    ``x.view(..., D/2, 2)``."""
    if is_op(node, aten.slice.Tensor):
        src, dim, start, end, step = _slice(node)
        expect(dim == val(src).dim() - 1 and step == 2 and start in (0, 1) and end >= val(src).shape[-1] - 1,
               "interleaved half is not x[..., 0::2] or x[..., 1::2]", node)
        return src, start
    if node.target is operator.getitem and is_op(node.args[0], aten.unbind.int):
        pairs, index = node.args[0].args[0], node.args[1]
        dim = node.args[0].args[1] if len(node.args[0].args) > 1 else 0
    elif is_op(node, aten.select.int):
        pairs, dim, index = node.args
    else:
        raise NoMatch(f"interleaved half {node.name} is not a strided slice or an unbind of pairs", node)
    expect(_last_axis(dim, pairs) and val(pairs).shape[-1] == 2, "pairs are not the last dim of size 2", node)
    expect_op(pairs, VIEW_OPS, "pairs")
    src = pairs.args[0]
    shape, pshape = tuple(val(src).shape), tuple(val(pairs).shape)
    expect(pshape[:-2] == shape[:-1] and pshape[-2] * 2 == shape[-1], "pairs view does not split the last dim", pairs)
    return src, index


def _interleaved_source(flat: fx.Node) -> fx.Node:
    """x for ``stack(-x_odd, x_even, -1).flatten(-2)``."""
    stack = single_use(expect_op(flat.args[0], aten.stack.default, "flattened rotate"), "rotate stack")
    tensors, dim = stack.args[0], stack.args[1] if len(stack.args) > 1 else stack.kwargs.get("dim", 0)
    expect(len(tensors) == 2 and _last_axis(dim, stack), f"stack of {len(tensors)} along dim {dim}, "
           "expected 2 along -1", stack)
    shape = tuple(val(stack).shape)
    expect(tuple(val(flat).shape) == shape[:-2] + (shape[-2] * 2,), "rotate view does not flatten the pairs", flat)
    first, second = tensors
    expect(_negated(first) is not None, "interleaved rotate negates the even channels, stack(x1, -x2): "
           "the opposite rotation to stack(-x2, x1)", stack)
    odd, odd_i = _pair_member(_negated(single_use(first, "rotate neg")))
    even, even_i = _pair_member(second)
    expect(_same_value(odd, even), "interleaved halves read different tensors", stack)
    expect((odd_i, even_i) == (1, 0), f"stack(-x[{odd_i}::2], x[{even_i}::2]), expected stack(-x[1::2], x[0::2])",
           stack)
    return odd


def _parse_rotate(node: fx.Node) -> tuple[fx.Node, bool] | None:
    """(x, interleaved) when ``node`` looks like a rotation; None when it is no rotation at all."""
    if is_op(node, aten.cat.default):
        return _rotate_half_source(node), False
    if is_op(node, *VIEW_OPS) and is_op(node.args[0], aten.stack.default):
        return _interleaved_source(node), True
    return None


# ---------------------------------------------------------------- cos/sin layout

def _padded_shape(node: fx.Node) -> list:
    shape = list(val(node).shape)
    return [1] * (4 - len(shape)) + shape


def _head_axis(cos: fx.Node, sin: fx.Node) -> int:
    """1 when the tables broadcast over dim 1 of x (x is [B, H, S, D]), 2 over dim 2 ([B, S, H, D])."""
    for t in (cos, sin):
        expect(val(t).dim() <= 4, f"{t.name} has rank {val(t).dim()}, expected <= 4", t)
    c, s = _padded_shape(cos), _padded_shape(sin)
    if c[1] == 1 and s[1] == 1:
        return 1
    if c[2] == 1 and s[2] == 1:
        return 2
    raise NoMatch(f"cos {c} varies along both dims 1 and 2 of x: no head axis to broadcast over", cos)


def _table(gm: fx.GraphModule, t: fx.Node, head_axis: int, bsr: list) -> fx.Node:
    """``t`` as [B, S, R]: drop its head axis, then expand batch/positions it broadcasts.
    ``bsr`` holds ints or sym_size nodes."""
    g = gm.graph
    if val(t).dim() == 4 and is_op(t, aten.unsqueeze.default) and t.args[1] % 4 == head_axis:
        node = t.args[0]  # transformers' cos.unsqueeze(unsqueeze_dim): the [B, S, R] table itself
    else:
        node = t
        for _ in range(4 - val(t).dim()):
            node = _call(g, aten.unsqueeze.default, node, 0)
        node = _call(g, aten.squeeze.dim, node, head_axis)
    keep = [statically_known_true(h == (val(b) if isinstance(b, fx.Node) else b))
            for h, b in zip(val(node).shape, bsr)]
    if not all(keep):
        node = _call(g, aten.expand.default, node, [-1 if k else b for k, b in zip(keep, bsr)])
    return node


def _sizes(graph: fx.Graph, x: fx.Node, dims: tuple[int, ...]) -> list:
    """x's sizes at ``dims`` as graph arguments: ints, or ``sym_size`` nodes for dynamic ones
    (a SymInt baked into a node's arguments names a symbol the generated code doesn't define)."""
    sizes = []
    for d in dims:
        size = val(x).shape[d]
        sizes.append(size if isinstance(size, int) else _call(graph, aten.sym_size.int, x, d))
    return sizes


def _call(graph: fx.Graph, target, *args) -> fx.Node:
    node = graph.call_function(target, args)
    ir.infer_val(node)
    return node


# ---------------------------------------------------------------- the pass

def _not_rope(add: fx.Node) -> str | None:
    """Why ``add`` is no rope at all (residuals, biases), or None when it may be one."""
    terms = add.args[:2]
    if len(terms) != 2 or not all(is_op(t, aten.mul.Tensor) for t in terms):
        return "not a sum of two products"
    factors = [f for t in terms for f in t.args]
    if not any(is_op(f, aten.cat.default) or (is_op(f, *VIEW_OPS) and is_op(f.args[0], aten.stack.default))
               for f in factors):
        return "no factor is a cat or a flattened stack (no rotate)"
    return None


class FuseRope(PatternPass):
    name = "fuse_rope"
    summary = "x * cos + rotate(x) * sin -> graphopt.rope (rotate-half, interleaved, partial, BSHD)"
    anchors = (aten.add.Tensor,)

    def screen(self, add: fx.Node) -> str | None:
        # Every other add in a model (residuals, biases) is no rope: --why groups them by reason.
        return _not_rope(add)

    def match(self, add: fx.Node, options) -> RopeMatch:
        expect("alpha" not in add.kwargs and len(add.args) == 2, "add has an alpha", add)
        terms = add.args
        expect(all(is_op(t, aten.mul.Tensor) for t in terms), "add is not of two products", add)
        found = None
        for i, term in enumerate(terms):
            for j in (0, 1):
                parsed = _parse_rotate(term.args[j])
                if parsed is not None:
                    found = (i, j, parsed)
                    break
            if found:
                break
        expect(found is not None, "neither product multiplies a rotate (cat of halves or flattened stack)", add)
        i, j, (x_rot, interleaved) = found
        rot_mul, x_mul = single_use(terms[i], "rotate product"), single_use(terms[1 - i], "cos product")
        single_use(rot_mul.args[j], "rotate")
        sin = rot_mul.args[1 - j]
        if _same_value(x_mul.args[0], x_rot):
            cos = x_mul.args[1]
        elif _same_value(x_mul.args[1], x_rot):
            cos = x_mul.args[0]
        else:
            raise NoMatch(f"rotate reads a different tensor ({x_rot.name}) than the one cos scales", x_mul)
        expect(isinstance(cos, fx.Node) and isinstance(sin, fx.Node), "cos or sin is not a tensor", add)
        expect(_trig(cos) != "sin" and _trig(sin) != "cos",
               "cos/sin swapped: x is scaled by sin and rotate(x) by cos", add)
        expect(val(x_rot).dim() == 4, f"x has rank {val(x_rot).dim()}, expected 4 ([B, H, S, D] or [B, S, H, D])",
               x_rot)
        shape = tuple(val(x_rot).shape)
        expect(tuple(val(add).shape) == shape, f"cos/sin broadcast x {list(shape)} up to "
               f"{list(val(add).shape)}", add)
        rot_dim = shape[-1]
        for t in (cos, sin):
            expect(val(t).shape[-1] == rot_dim, f"{t.name} has {val(t).shape[-1]} channels, expected "
                   f"{rot_dim}", t)
        expect(val(cos).dtype == val(sin).dtype, f"cos is {val(cos).dtype}, sin {val(sin).dtype}", sin)
        head_axis = _head_axis(cos, sin)
        x, output = _partial_rotary(x_rot, add, rot_dim)
        return RopeMatch(x, cos, sin, rot_dim, interleaved, head_axis, output)

    def rewrite(self, gm: fx.GraphModule, m: RopeMatch, options) -> None:
        g = gm.graph
        with g.inserting_before(m.output):
            x = m.x if m.head_axis == 1 else _call(g, aten.transpose.int, m.x, 1, 2)
            bsr = _sizes(g, x, (0, 2)) + [m.rot_dim]
            cos, sin = _table(gm, m.cos, m.head_axis, bsr), _table(gm, m.sin, m.head_axis, bsr)
            fused = _call(g, torch.ops.graphopt.rope.default, x, cos, sin, m.interleaved)
            out = fused if m.head_axis == 1 else _call(g, aten.transpose.int, fused, 1, 2)
            result = restride_like(g, cast_like(gm, out, m.output), m.output)
        m.output.replace_all_uses_with(result)


def _partial_rotary(x_rot: fx.Node, add: fx.Node, rot_dim: int) -> tuple[fx.Node, fx.Node]:
    """(x, output): x and ``cat(rope(x[..., :R]), x[..., R:])`` for partial rotary, else (x_rot, add)."""
    if not is_op(x_rot, aten.slice.Tensor) or len(add.users) != 1:
        return x_rot, add
    cat = next(iter(add.users))
    try:
        x, dim, start, end, step = _slice(x_rot)
    except NoMatch:
        return x_rot, add
    if not (is_op(cat, aten.cat.default) and dim == val(x).dim() - 1 and start == 0 and step == 1):
        return x_rot, add
    tensors = cat.args[0]
    cat_dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if len(tensors) != 2 or tensors[0] is not add or not _last_axis(cat_dim, cat):
        return x_rot, add
    rest = tensors[1]
    if not is_op(rest, aten.slice.Tensor):
        return x_rot, add
    try:
        src, rdim, rstart, rend, rstep = _slice(rest)
    except NoMatch:
        return x_rot, add
    width = val(x).shape[-1]
    if _same_value(src, x) and rdim == dim and rstart == rot_dim == end and rend == width and rstep == 1:
        return x, cat
    return x_rot, add  # the rope of the slice alone still fuses


fuse_rope = FuseRope()
