"""LayerNorm: ``native_layer_norm(x, [H], w, b, eps)[0]`` or
``(x - mean(x)) / sqrt(var(x) + eps) * w + b  ->  graphopt.layer_norm(x, w, b, eps)``, and
with a residual add in front, ``layer_norm(a + b)  ->  graphopt.add_layer_norm(a, b, w, bias, eps)``
returning (normed, a + b).

Why: the decomposed form reads the row four times and writes five temporaries, and even the
native op leaves the residual add as its own kernel; the fused op reads each input once and
writes the sum for the residual stream in the same pass (a Triton kernel, ORT's
LayerNormalization / SkipLayerNormalization).

Spellings matched: ``aten.native_layer_norm`` + getitem 0 (nn.LayerNorm, F.layer_norm under
aot_autograd), ``aten.layer_norm`` (torch.export); the decomposed form with ``sqrt`` + div or
``rsqrt`` + mul, the variance as ``var(x, correction=0)``, ``var_mean`` or the mean of the
squared deviations (``pow(x - u, 2)`` or ``d * d``, the deviation computed once or twice);
the weight and bias on either side; no weight or no bias; and the decomposed rsqrt form that
``fuse_rms_norm`` already turned into ``rms_norm(x - mean(x)) + b``.
Preconditions: normalisation over the last axis only; eps is a constant; the variance is
biased (correction 0); weight and bias are [H]; native_layer_norm's mean/rstd outputs are
unused; every intermediate is read only inside the pattern. The residual add is folded in
only when both operands have the sum's shape and dtype and there is no alpha; other users of
the sum read the fused op's second output.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.rewrite import (
    ADD_OPS, cast_like, expect, expect_op, is_last_dim, is_op, match_residual_add, NoMatch, PatternPass, scalar, val,
)

aten = torch.ops.aten
graphopt_ops = torch.ops.graphopt


@dataclass
class LayerNormMatch:
    x: fx.Node  # the normalised input (the residual sum when one is folded in)
    weight: fx.Node | None
    bias: fx.Node | None
    eps: float
    output: fx.Node  # the node whose value the fused op replaces
    inner: set[fx.Node] = field(default_factory=set)  # pattern nodes that die with the rewrite
    residual: tuple[fx.Node, fx.Node] | None = None  # (a, b) of x = a + b
    insert_before: fx.Node | None = None  # where the fused op goes (None: before the output)
    left_out: list[tuple[str, str]] = field(default_factory=list)  # (node, why) kept outside the op


def arg(node: fx.Node, index: int, name: str, default=None):
    """Argument ``index`` / keyword ``name`` of a call, whichever way it was passed."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def shape_of(node) -> list[int] | None:
    v = val(node)
    return list(v.shape) if isinstance(v, torch.Tensor) else None


def other_operand(node: fx.Node, known) -> object:
    return node.args[1] if node.args[0] is known else node.args[0]


def same_call(a: fx.Node, b: fx.Node) -> bool:
    """Two nodes that compute the same value (the deviation ``x - u`` spelled twice)."""
    return a is b or (is_op(a, getattr(b, "target", None)) and is_op(b, a.target)
                      and a.args == b.args and a.kwargs == b.kwargs)


def expect_only_inner(nodes, inner: set[fx.Node]) -> None:
    """Every intermediate is read inside the pattern only: another reader would lose it."""
    for node in nodes:
        outside = [u for u in node.users if u not in inner]
        expect(not outside, f"{node.name} is also read by {outside[0].name if outside else ''} outside the "
                            "layer norm; a fusion would lose it", node)


def match_mean_of_x(mean: fx.Node, what: str) -> fx.Node:
    """``mean(x, -1, keepdim=True)`` (or var_mean's mean); returns x."""
    if is_op(mean, operator.getitem) and is_op(mean.args[0], aten.var_mean.correction):
        expect(mean.args[1] == 1, f"{what}: var_mean output {mean.args[1]} is not the mean", mean)
        return mean.args[0].args[0]
    expect_op(mean, aten.mean.dim, what)
    x, dims, keepdim = mean.args[0], mean.args[1], arg(mean, 2, "keepdim", False)
    shown = dims[0] if isinstance(dims, (list, tuple)) and len(dims) == 1 else dims
    expect(is_last_dim(dims, x), f"mean over dim {shown}, expected -1", mean)
    expect(bool(keepdim), "mean drops the reduced dim (keepdim=False)", mean)
    return x


def match_centered(node, what: str) -> tuple[fx.Node, fx.Node]:
    """``x - mean(x)``; returns (x, mean)."""
    expect_op(node, aten.sub.Tensor, what)
    expect(arg(node, 2, "alpha", 1) == 1, "deviation x - u has an alpha", node)
    x, mean = node.args[0], node.args[1]
    expect(match_mean_of_x(mean, "subtracted mean") is x, "subtracts the mean of another tensor", node)
    return x, mean


def match_variance(var) -> tuple[fx.Node, set[fx.Node], fx.Node | None]:
    """The biased variance of x; returns (x, its nodes, the deviation it squares if any)."""
    if is_op(var, operator.getitem) and is_op(var.args[0], aten.var_mean.correction):
        vm = var.args[0]
        check_correction(vm, arg(vm, 2, "correction", None))
        expect_last_axis_keepdim(vm, arg(vm, 1, "dim", None), vm.kwargs.get("keepdim", False))
        return vm.args[0], {var, vm}, None
    if is_op(var, aten.var.correction):
        check_correction(var, var.kwargs.get("correction", arg(var, 2, "correction", None)))
        expect_last_axis_keepdim(var, arg(var, 1, "dim", None), var.kwargs.get("keepdim", False))
        return var.args[0], {var}, None
    if is_op(var, aten.var.dim):
        expect(arg(var, 2, "unbiased", True) is False, "variance is unbiased, expected unbiased=False", var)
        expect_last_axis_keepdim(var, var.args[1], arg(var, 3, "keepdim", False))
        return var.args[0], {var}, None
    expect_op(var, aten.mean.dim, "variance")
    dims = var.args[1]
    shown = dims[0] if isinstance(dims, (list, tuple)) and len(dims) == 1 else dims
    expect(is_last_dim(dims, var.args[0]), f"variance over dim {shown}, expected -1", var)
    expect(bool(arg(var, 2, "keepdim", False)), "variance drops the reduced dim (keepdim=False)", var)
    square = var.args[0]
    if is_op(square, aten.pow.Tensor_Scalar):
        expect(scalar(square.args[1]) == 2.0, f"power {square.args[1]}, expected 2", square)
    elif is_op(square, aten.mul.Tensor):
        expect(same_call(square.args[0], square.args[1]), "mul is not d * d", square)
    else:
        raise NoMatch("variance: mean input is not a square (pow or d * d)", square)
    deviation = square.args[0]
    expect(is_op(deviation, aten.sub.Tensor), "variance is mean(v^2) of a v that is not x - mean(x) (an RMSNorm?)",
           deviation)
    x, mean = match_centered(deviation, "squared value")
    return x, {var, square, mean, *(a for a in square.args[:2] if isinstance(a, fx.Node))}, deviation


def check_correction(node: fx.Node, correction) -> None:
    shown = "1 (unbiased)" if correction is None or scalar(correction) == 1.0 else correction
    expect(correction is not None and scalar(correction) == 0.0, f"variance correction {shown}, expected 0", node)


def expect_last_axis_keepdim(node: fx.Node, dims, keepdim) -> None:
    shown = dims[0] if isinstance(dims, (list, tuple)) and len(dims) == 1 else dims
    expect(dims is not None and is_last_dim(dims, node.args[0]), f"variance over dim {shown}, expected -1", node)
    expect(bool(keepdim), "variance drops the reduced dim (keepdim=False)", node)


def match_affine(normed: fx.Node, hidden: int, inner: set[fx.Node]):
    """The optional ``* w`` then ``+ b`` after the normalisation; returns (w, b, output)."""
    weight = bias = None
    out = normed
    if len(out.users) == 1 and is_op(user := next(iter(out.users)), aten.mul.Tensor):
        cand = other_operand(user, out)
        if isinstance(cand, fx.Node) and shape_of(cand) == [hidden]:
            weight, out = cand, user
            inner.add(user)
    if len(out.users) == 1 and is_op(user := next(iter(out.users)), aten.add.Tensor) and "alpha" not in user.kwargs:
        cand = other_operand(user, out)
        if isinstance(cand, fx.Node) and shape_of(cand) == [hidden]:
            bias, out = cand, user
            inner.add(user)
    return weight, bias, out


class FuseLayerNorm(PatternPass):
    name = "fuse_layer_norm"
    summary = "LayerNorm (native or decomposed), with its residual add -> graphopt.layer_norm / add_layer_norm"
    anchors = (aten.native_layer_norm.default, aten.layer_norm.default, aten.rsqrt.default, aten.sqrt.default,
               graphopt_ops.rms_norm.default)

    def screen(self, anchor: fx.Node) -> str | None:
        # rms_norm is a LayerNorm only over x - mean(x); every real RMSNorm is one of these.
        if anchor.target is graphopt_ops.rms_norm.default and not is_op(anchor.args[0], aten.sub.Tensor):
            return "rms_norm of a value that is not x - mean(x): an RMSNorm, not a LayerNorm"
        return None

    def match(self, anchor: fx.Node, options) -> LayerNormMatch:
        if anchor.target is aten.native_layer_norm.default:
            m = self.match_native(anchor)
        elif anchor.target is aten.layer_norm.default:
            m = self.match_layer_norm(anchor)
        elif anchor.target is graphopt_ops.rms_norm.default:
            m = self.match_rms_of_centered(anchor)
        else:
            m = self.match_decomposed(anchor)
        return self.match_residual(m, anchor)

    # -- spellings -------------------------------------------------------------------------

    def match_native(self, ln: fx.Node) -> LayerNormMatch:
        x, shape, weight, bias, eps = ln.args[:5]
        self.check_normalized_shape(ln, x, shape)
        expect(scalar(eps) is not None, "eps is not a constant", ln)
        used = sorted({u.args[1] for u in ln.users if is_op(u, operator.getitem)} - {0})
        expect(all(is_op(u, operator.getitem) for u in ln.users), "native_layer_norm's tuple is read whole", ln)
        expect(not used, f"mean/rstd outputs (getitem {', '.join(map(str, used))}) are used", ln)
        outs = list(ln.users)
        expect(len(outs) == 1, f"native_layer_norm output 0 is read by {len(outs)} getitems", ln)
        return LayerNormMatch(x, weight, bias, scalar(eps), outs[0], inner={ln, outs[0]})

    def match_layer_norm(self, ln: fx.Node) -> LayerNormMatch:
        x, shape = ln.args[0], arg(ln, 1, "normalized_shape")
        self.check_normalized_shape(ln, x, shape)
        eps = scalar(arg(ln, 4, "eps", 1e-5))
        expect(eps is not None, "eps is not a constant", ln)
        return LayerNormMatch(x, arg(ln, 2, "weight"), arg(ln, 3, "bias"), eps, ln, inner={ln})

    def check_normalized_shape(self, ln: fx.Node, x: fx.Node, shape) -> None:
        dims = list(shape)
        expect(len(dims) == 1, f"normalized over {len(dims)} dims {dims}, expected the last", ln)
        full = shape_of(x)
        expect(full is not None and full[-1:] == dims, f"normalized shape {dims} is not the last dim of {full}", ln)

    def match_decomposed(self, root: fx.Node) -> LayerNormMatch:
        op = "rsqrt" if root.target is aten.rsqrt.default else "sqrt"
        add = expect_op(root.args[0], ADD_OPS, f"{op} input")
        var, eps = add.args[0], scalar(add.args[1])
        if eps is None and isinstance(add.args[1], fx.Node):  # eps + var written the other way round
            var, eps = add.args[1], scalar(add.args[0])
        expect(eps is not None, "eps is not a constant", add)
        x, var_nodes, squared = match_variance(var)
        expect(len(root.users) == 1, f"{op} {root.name} has {len(root.users)} users, expected 1", root)
        normed = next(iter(root.users))
        if op == "rsqrt":
            expect_op(normed, aten.mul.Tensor, "rsqrt user")
            deviation = other_operand(normed, root)
        else:
            expect_op(normed, aten.div.Tensor, "sqrt user")
            expect(normed.args[1] is root, "divides the standard deviation, not by it", normed)
            deviation = normed.args[0]
        x_num, mean = match_centered(deviation, f"{op} scales")
        expect(x_num is x, "normalises a different tensor than the variance reads", normed)
        if squared is not None:
            expect(same_call(squared, deviation), "squares a different deviation than it normalises", squared)
        inner = {root, add, normed, deviation, mean, *var_nodes}
        weight, bias, output = match_affine(normed, shape_of(x)[-1], inner)
        expect_only_inner(inner - {output}, inner)
        return LayerNormMatch(x, weight, bias, eps, output, inner=inner)

    def match_rms_of_centered(self, rms: fx.Node) -> LayerNormMatch:
        """``rms_norm(x - mean(x), w) + b`` (fuse_rms_norm ran first): exactly a LayerNorm."""
        deviation, weight, eps = rms.args[0], arg(rms, 1, "weight"), arg(rms, 2, "eps")
        offset = arg(rms, 3, "weight_offset", 0.0)
        expect(not offset, f"rms_norm has weight_offset {offset}; layer_norm has none", rms)
        x, mean = match_centered(deviation, "rms_norm input")
        inner = {rms, deviation, mean}
        bias, output = None, rms
        hidden = shape_of(x)[-1]
        if len(rms.users) == 1 and is_op(user := next(iter(rms.users)), aten.add.Tensor) \
                and "alpha" not in user.kwargs:
            cand = other_operand(user, rms)
            if isinstance(cand, fx.Node) and shape_of(cand) == [hidden]:
                bias, output = cand, user
                inner.add(user)
        expect_only_inner(inner - {output}, inner)
        return LayerNormMatch(x, weight, bias, eps, output, inner=inner)

    # -- shared checks ---------------------------------------------------------------------

    def match_residual(self, m: LayerNormMatch, anchor: fx.Node) -> LayerNormMatch:
        hidden = shape_of(m.x)[-1]
        for what, t in (("weight", m.weight), ("bias", m.bias)):
            expect(t is None or shape_of(t) == [hidden], f"{what} {shape_of(t)} is not [{hidden}]", anchor)
        s = m.x
        if not is_op(s, *ADD_OPS):
            return m
        try:
            residual = match_residual_add(s, "norm input")
        except NoMatch as why:  # still a plain LayerNorm; say why the add stayed outside
            m.left_out.append((s.name, f"{why.reason}; fused without the add"))
            return m
        a, b = residual.a, residual.b
        # Right after the sum, so that its other readers can read the fused op's copy instead.
        point = max([s] + [t for t in (m.weight, m.bias) if isinstance(t, fx.Node)])
        early = [u for u in s.users if u not in m.inner and not u > point]
        expect(not early, f"the sum is read by {early[0].name if early else ''} before the weight exists", s)
        m.residual, m.insert_before = (a, b), point.next
        return m

    def rewrite(self, gm: fx.GraphModule, m: LayerNormMatch, options) -> None:
        with gm.graph.inserting_before(m.insert_before or m.output):
            if m.residual is None:
                fused = gm.graph.call_function(graphopt_ops.layer_norm.default, (m.x, m.weight, m.bias, m.eps))
                result = cast_like(gm, fused, m.output)
            else:
                fused = gm.graph.call_function(graphopt_ops.add_layer_norm.default, (*m.residual, m.weight, m.bias,
                                                                                     m.eps))
                ir.infer_val(fused)
                normed = gm.graph.call_function(operator.getitem, (fused, 0))
                total = gm.graph.call_function(operator.getitem, (fused, 1))
                result = cast_like(gm, normed, m.output)
        m.output.replace_all_uses_with(result)
        if m.residual is not None:
            # the residual stream reads the sum from the fused op; the pattern's own reads die
            m.x.replace_all_uses_with(total, delete_user_cb=lambda user: user not in m.inner)


fuse_layer_norm = FuseLayerNorm()
