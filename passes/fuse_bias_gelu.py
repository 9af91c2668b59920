"""GELU with its bias add: ``gelu(x + b)`` / ``gelu(view(addmm(b, x2d, wt)))``
->  ``graphopt.bias_gelu(x, b, approximate)`` / ``graphopt.bias_gelu(view(mm(x2d, wt)), b)``.

Why: the bias add and the activation are two elementwise passes over the FFN's widest
tensor; fused they are one (ORT's BiasGelu / FastGelu with bias, a Triton GEMM epilogue).
Moving a Linear's bias out of ``addmm`` into the activation is what hands the backend that
bias: the GEMM becomes a plain ``mm`` and the epilogue adds the bias and applies GELU.

Spellings matched: ``aten.gelu`` (erf and tanh); GELU written by hand as
``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))`` (GPT-2's gelu_new, HF's
NewGELUActivation, and FastGELU's ``x * 0.7978845608 * (1 + 0.044715 * x * x)``) and as
``x * 0.5 * (1 + erf(x / sqrt(2)))``. The bias: ``addmm(b, x2d, wt)`` (with or without a view
to 3-D), ``linear(x, w, b)`` (torch.export), or an explicit ``x + b``. No bias: the op takes None.
Preconditions: the bias is a 1-D [N] vector over the last dim; addmm has beta = alpha = 1;
the bias add, addmm and view have no reader outside the pattern; a hand-written GELU's
constants are the standard ones (to 1e-5 relative) and its intermediates are read only inside.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.rewrite import (
    ADD_OPS, SUB_OPS, VIEW_OPS, cast_like, expect, expect_op, is_op, NoMatch, PatternPass, scalar, val,
)

aten = torch.ops.aten
graphopt_ops = torch.ops.graphopt

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
TANH_COEFF = 0.044715
INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_RTOL = 1e-5  # hand-written constants: 0.7978845608 and x / 1.41421 are both sqrt(2/pi), 1/sqrt(2)


def close(value: float, want: float) -> bool:
    return abs(value - want) <= _RTOL * abs(want)


def shape_of(node) -> list[int] | None:
    v = val(node)
    return list(v.shape) if isinstance(v, torch.Tensor) else None


@dataclass
class BiasGeluMatch:
    x: fx.Node  # the activation's input without its bias
    approximate: str
    output: fx.Node  # the node whose value the fused op replaces
    inner: set[fx.Node] = field(default_factory=set)  # pattern nodes that read x
    bias: fx.Node | None = None
    # How the bias came out of a GEMM: ("addmm", addmm, view-or-None) / ("linear", linear, None).
    gemm: tuple | None = None


# -- hand-written GELU -----------------------------------------------------------------------


def other_operand(node: fx.Node, known) -> object:
    return node.args[1] if node.args[0] is known else node.args[0]


def single_user(node: fx.Node, what: str) -> fx.Node:
    expect(len(node.users) == 1, f"{what} {node.name} has {len(node.users)} users, expected 1", node)
    return next(iter(node.users))


def times_half(node) -> fx.Node | None:
    """x for ``x * 0.5``, ``0.5 * x`` or ``x / 2``; else None."""
    if is_op(node, aten.mul.Tensor, aten.mul.Scalar):
        for a, b in (node.args[:2], node.args[1::-1]):
            if isinstance(a, fx.Node) and scalar(b) == 0.5:
                return a
    if is_op(node, aten.div.Tensor, aten.div.Scalar) and scalar(node.args[1]) == 2.0:
        return node.args[0]
    return None


def match_outer(fn: fx.Node, inner: set[fx.Node]) -> tuple[fx.Node, fx.Node]:
    """``0.5 * x * (1 + fn)`` in any association; returns (x, output)."""
    name = "tanh" if fn.target is aten.tanh.default else "erf"
    one_plus = expect_op(single_user(fn, name), ADD_OPS, f"{name} user")
    expect(scalar(other_operand(one_plus, fn)) == 1.0, f"adds {other_operand(one_plus, fn)} to {name}, expected 1",
           one_plus)
    inner |= {fn, one_plus}
    prod = expect_op(single_user(one_plus, f"1 + {name}"), aten.mul.Tensor, f"1 + {name} user")
    inner.add(prod)
    factor = other_operand(prod, one_plus)
    if scalar(factor) == 0.5:  # (0.5 * (1 + t)) * x
        last = expect_op(single_user(prod, "0.5 * (1 + t)"), aten.mul.Tensor, "0.5 * (1 + t) user")
        x = other_operand(last, prod)
        expect(isinstance(x, fx.Node), "(1 + t) * 0.5 is scaled by a constant, not by x", last)
        inner.add(last)
        return x, last
    expect(isinstance(factor, fx.Node), f"1 + {name} is scaled by {factor}, expected 0.5 * x", prod)
    x = times_half(factor)
    if x is not None:  # (0.5 * x) * (1 + t)
        expect(len(factor.users) == 1, f"0.5 * x {factor.name} is also read outside the GELU", factor)
        inner.add(factor)
        return x, prod
    last = single_user(prod, f"x * (1 + {name})")  # (x * (1 + t)) * 0.5
    expect(times_half(last) is prod, f"x * (1 + {name}) is not halved", last)
    inner.add(last)
    return factor, last


def polynomial(node, x: fx.Node, inner: set[fx.Node]) -> dict[int, float]:
    """``node`` as a polynomial in ``x`` ({power: coefficient}); NoMatch if it is not one."""
    if node is x:
        return {1: 1.0}
    c = scalar(node)
    if c is not None:
        return {0: c}
    expect(isinstance(node, fx.Node), f"{node!r} is not a number or x")
    inner.add(node)
    if is_op(node, aten.mul.Tensor, aten.mul.Scalar):
        return _product(polynomial(node.args[0], x, inner), polynomial(node.args[1], x, inner))
    if is_op(node, aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar):
        alpha = scalar(node.kwargs.get("alpha", 1))
        expect(alpha is not None, "add with a tensor alpha", node)
        sign = -alpha if node.target in SUB_OPS else alpha
        out = Counter(polynomial(node.args[0], x, inner))
        for power, coeff in polynomial(node.args[1], x, inner).items():
            out[power] += sign * coeff
        return dict(out)
    if is_op(node, aten.div.Tensor, aten.div.Scalar):
        d = scalar(node.args[1])
        expect(d is not None and d != 0.0 and "rounding_mode" not in node.kwargs, "divides by a tensor", node)
        return {p: c / d for p, c in polynomial(node.args[0], x, inner).items()}
    if is_op(node, aten.pow.Tensor_Scalar):
        n = scalar(node.args[1])
        expect(n is not None and n == int(n) and 0 <= n <= 4, f"power {node.args[1]} is not a small integer", node)
        out = {0: 1.0}
        for _ in range(int(n)):
            out = _product(out, polynomial(node.args[0], x, inner))
        return out
    raise NoMatch(f"{node.name} ({ir.target_name(node.target)}) is not a polynomial in x", node)


def _product(a: dict[int, float], b: dict[int, float]) -> dict[int, float]:
    out: Counter = Counter()
    for pa, ca in a.items():
        for pb, cb in b.items():
            out[pa + pb] += ca * cb
    return dict(out)


def _terms(poly: dict[int, float]) -> set[int]:
    return {p for p, c in poly.items() if c != 0.0}


def match_handwritten(fn: fx.Node) -> BiasGeluMatch:
    inner: set[fx.Node] = set()
    x, output = match_outer(fn, inner)
    poly = polynomial(fn.args[0], x, inner)
    for node in inner - {output}:  # a reader outside would lose the intermediate
        outside = [u for u in node.users if u not in inner]
        expect(not outside, f"{node.name} is also read by {outside[0].name if outside else ''} outside the GELU", node)
    if fn.target is aten.erf.default:
        expect(_terms(poly) == {1}, "erf argument is not a multiple of x", fn)
        expect(close(poly[1], INV_SQRT_2), f"erf scale {poly[1]:.6g}, expected {INV_SQRT_2:.6g} (1/sqrt(2))", fn)
        return BiasGeluMatch(x, "none", output, inner)
    expect(_terms(poly) == {1, 3}, "tanh argument is not c * (x + k * x^3)", fn)
    coeff = poly[3] / poly[1]
    expect(close(coeff, TANH_COEFF), f"tanh coefficient {coeff:.6g}, expected {TANH_COEFF:g}", fn)
    expect(close(poly[1], SQRT_2_OVER_PI), f"tanh scale {poly[1]:.6g}, expected {SQRT_2_OVER_PI:.6g} (sqrt(2/pi))",
           fn)
    return BiasGeluMatch(x, "tanh", output, inner)


# -- the bias --------------------------------------------------------------------------------


def check_vector(bias, hidden: int, node: fx.Node) -> None:
    shape = shape_of(bias)
    shown = shape if shape is not None else bias
    expect(shape is not None and len(shape) == 1, f"bias {shown} is not a per-channel vector", node)
    expect(shape == [hidden], f"bias {shape} does not match the last dim {hidden}", node)


def absorb_bias(m: BiasGeluMatch) -> BiasGeluMatch:
    """Take the bias out of the add / addmm / linear that feeds the activation, if any."""
    x = m.x
    outside = [u for u in x.users if u not in m.inner]
    hidden = shape_of(m.output)[-1]
    gemm, view = x, None
    if is_op(x, *VIEW_OPS) and is_op(x.args[0], aten.addmm.default):
        gemm, view = x.args[0], x
    if is_op(gemm, aten.addmm.default):
        for key in ("beta", "alpha"):
            factor = scalar(gemm.kwargs.get(key, 1))
            expect(factor == 1.0, f"addmm has {key}={gemm.kwargs.get(key)}, expected 1", gemm)
        bias = gemm.args[0]
        check_vector(bias, hidden, gemm)
        expect(shape_of(gemm)[-1] == hidden, f"view changes the last dim {shape_of(gemm)[-1]} -> {hidden}", view)
        expect(not outside, f"{x.name} is also read by {outside[0].name if outside else ''}", x)
        if view is not None:
            expect(len(gemm.users) == 1, f"addmm {gemm.name} has {len(gemm.users)} users, expected 1", gemm)
        m.bias, m.gemm = bias, ("addmm", gemm, view)
        return m
    if is_op(x, aten.linear.default) and len(x.args) > 2 and x.args[2] is not None:
        check_vector(x.args[2], hidden, x)
        expect(not outside, f"linear {x.name} is also read by {outside[0].name if outside else ''}", x)
        m.bias, m.gemm = x.args[2], ("linear", x, None)
        return m
    if is_op(x, aten.add.Tensor):
        expect("alpha" not in x.kwargs, "bias add has an alpha", x)
        a, b = x.args[:2]
        full = shape_of(x)
        if shape_of(b) == full and shape_of(a) != full:
            a, b = b, a  # bias + x
        expect(isinstance(a, fx.Node) and shape_of(a) == full, f"bias add's input {shape_of(a)} is not {full}", x)
        check_vector(b, hidden, x)
        expect(not outside, f"bias add {x.name} is also read by {outside[0].name if outside else ''}", x)
        m.x, m.bias = a, b
    return m


class FuseBiasGelu(PatternPass):
    name = "fuse_bias_gelu"
    summary = "gelu(x + b), addmm bias + gelu, hand-written tanh/erf GELU -> graphopt.bias_gelu"
    anchors = (aten.gelu.default, aten.tanh.default, aten.erf.default)

    def match(self, anchor: fx.Node, options) -> BiasGeluMatch:
        if anchor.target is aten.gelu.default:
            approximate = anchor.kwargs.get("approximate", anchor.args[1] if len(anchor.args) > 1 else "none")
            m = BiasGeluMatch(anchor.args[0], approximate, anchor, {anchor})
        else:
            m = match_handwritten(anchor)
        return absorb_bias(m)

    def rewrite(self, gm: fx.GraphModule, m: BiasGeluMatch, options) -> None:
        graph = gm.graph
        with graph.inserting_before(m.output):
            x = m.x
            if m.gemm is not None and m.gemm[0] == "addmm":
                _, addmm, view = m.gemm
                x = graph.call_function(aten.mm.default, tuple(addmm.args[1:3]))
                ir.infer_val(x)
                if view is not None:
                    x = graph.call_function(view.target, (x, *view.args[1:]), dict(view.kwargs))
                    ir.infer_val(x)
            elif m.gemm is not None:
                linear = m.gemm[1]
                x = graph.call_function(aten.linear.default, (linear.args[0], linear.args[1]))
                ir.infer_val(x)
            fused = graph.call_function(graphopt_ops.bias_gelu.default, (x, m.bias, m.approximate))
            result = cast_like(gm, fused, m.output)
        m.output.replace_all_uses_with(result)


fuse_bias_gelu = FuseBiasGelu()
