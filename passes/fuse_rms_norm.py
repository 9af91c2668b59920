"""RMSNorm: ``x * rsqrt(mean(x^2, -1) + eps) * w  ->  graphopt.rms_norm(x, w, eps)``.

Why: the decomposed form reads the row three times and writes four temporaries; the
fused op reads it once (a Triton kernel, ORT's SimplifiedLayerNormalization).

Spellings matched, named by how the inverse square root of ``v = mean(x^2, -1) + eps`` is
written (the pass anchors on that op):
- ``rms_norm_via_rsqrt``: ``x * rsqrt(v)`` (Llama, Hugging Face)
- ``rms_norm_via_pow``: ``x * v.pow(-0.5)`` (also ``v ** -0.5``)
- ``rms_norm_via_reciprocal_sqrt``: ``x * (1 / sqrt(v))`` (aot: ``reciprocal(sqrt(v))``)
- ``rms_norm_via_div_sqrt``: ``x / sqrt(v)``
- ``rms_norm_via_aten``: ``aten.rms_norm`` itself (``nn.RMSNorm``, ``F.rms_norm``), which
  torch.export keeps whole (aot_autograd decomposes it into the rsqrt spelling); its
  default eps is float32's machine epsilon, and it scales by w in float32 before rounding
  to x's dtype, so a narrow x is read through a float32 cast
each with ``x.pow(2)`` or ``x * x`` for the square, eps on either side of the add; a
float32 upcast of x and a downcast of the result around it (Hugging Face); the weight on
either side of the multiply; ``(1 + w)`` scaling (Gemma), carried as ``weight_offset``; no
weight. The fused op computes ``x * rsqrt(v)``: the div and pow spellings differ from it by
rounding only (an ulp of float32).
Preconditions: the mean reduces the last axis with keepdim; eps is a constant; the
inverse root scales the same tensor that was squared; every intermediate has one user.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.rewrite import (
    ADD_OPS, MUL_OPS, RECIPROCAL_OPS, call_args, cast_like, commuted, expect, expect_op, is_cast, is_exact_upcast,
    is_last_dim, is_op, NoMatch, only_user, PatternPass, scalar, single_use, val,
)

aten = torch.ops.aten


@dataclass
class RmsNormMatch:
    x: fx.Node  # the input the fused op reads
    weight: fx.Node | None
    weight_offset: float
    eps: float
    output: fx.Node  # the node whose value the fused op replaces
    upcast: bool = False  # read x and w as float32 (aten.rms_norm scales by w before rounding)


@dataclass
class InverseRoot:
    """``normed = scaled * v^-1/2``, however the inverse square root is written."""

    variance_eps: fx.Node  # v = mean(x^2) + eps
    normed: fx.Node
    scaled: object  # the tensor the inverse root scales (must be x)


def _scaled_by(normed: fx.Node, inverse: fx.Node, what: str) -> InverseRoot:
    """``normed`` must be ``scaled * inverse`` in either operand order."""
    expect_op(normed, MUL_OPS, f"{what} user")
    _, scaled = commuted(normed, lambda n: n is inverse, what)
    return InverseRoot(inverse.args[0], normed, scaled)


def rms_norm_via_rsqrt(rsqrt: fx.Node) -> InverseRoot:
    return _scaled_by(only_user(rsqrt, "rsqrt"), rsqrt, "rsqrt")


def rms_norm_via_pow(power: fx.Node) -> InverseRoot:
    # screen() let only pow(v, -0.5) through
    return _scaled_by(only_user(power, "pow(v, -0.5)"), power, "pow(v, -0.5)")


def rms_norm_via_reciprocal_sqrt(sqrt: fx.Node, one_over: fx.Node) -> InverseRoot:
    """``x * (1 / sqrt(v))``: aot writes ``1 / t`` as ``reciprocal(t)``, export may keep the div."""
    found = _scaled_by(only_user(one_over, "1 / sqrt"), one_over, "1 / sqrt")
    return InverseRoot(sqrt.args[0], found.normed, found.scaled)


def rms_norm_via_div_sqrt(sqrt: fx.Node, div: fx.Node) -> InverseRoot:
    expect(div.args[1] is sqrt, "divides sqrt(v) by a tensor, not a tensor by sqrt(v)", div)
    return InverseRoot(sqrt.args[0], div, div.args[0])


def rms_norm_via_sqrt(sqrt: fx.Node) -> InverseRoot:
    """Which sqrt spelling it is, read from the sqrt's one user."""
    user = only_user(sqrt, "sqrt")
    if is_op(user, *RECIPROCAL_OPS) or (
            is_op(user, aten.div.Tensor) and user.args[1] is sqrt and scalar(user.args[0]) == 1.0):
        return rms_norm_via_reciprocal_sqrt(sqrt, user)
    if is_op(user, aten.div.Tensor):
        return rms_norm_via_div_sqrt(sqrt, user)
    raise NoMatch(f"sqrt user: expected x / sqrt(v) or 1 / sqrt(v), found {ir.target_name(user.target)}", user)


# The inverse square root, by the op that takes the root: the pass's anchors.
INVERSE_ROOT: dict[object, Callable[[fx.Node], InverseRoot]] = {
    aten.rsqrt.default: rms_norm_via_rsqrt,
    aten.pow.Tensor_Scalar: rms_norm_via_pow,
    aten.sqrt.default: rms_norm_via_sqrt,
}


def match_rms_core(root: fx.Node) -> tuple[fx.Node, fx.Node, float]:
    """From the inverse root of ``mean(x^2) + eps`` return (x_squared, normed = x * v^-1/2, eps)."""
    core = INVERSE_ROOT[root.target](root)
    root_name = ir.target_name(root.target).removeprefix("aten.")
    add = single_use(expect_op(core.variance_eps, ADD_OPS, f"{root_name} input"), "variance + eps")
    mean, eps = add.args[0], scalar(add.args[1])
    if eps is None and isinstance(add.args[1], fx.Node):  # eps + mean written the other way round
        mean, eps = add.args[1], scalar(add.args[0])
    expect(eps is not None, "eps is not a constant", add)
    single_use(expect_op(mean, aten.mean.dim, "variance"), "variance")
    dims, keepdim = mean.args[1], (mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False))
    shown = dims[0] if isinstance(dims, (list, tuple)) and len(dims) == 1 else dims
    expect(is_last_dim(dims, mean.args[0]), f"mean over dim {shown}, expected -1", mean)
    expect(bool(keepdim), "mean drops the reduced dim (keepdim=False)", mean)
    square = single_use(mean.args[0], "square")
    if is_op(square, aten.pow.Tensor_Scalar):
        expect(scalar(square.args[1]) == 2.0, f"power {square.args[1]}, expected 2", square)
        x = square.args[0]
    elif is_op(square, aten.mul.Tensor):
        expect(square.args[0] is square.args[1], "mul is not x * x", square)
        x = square.args[0]
    else:
        raise NoMatch("mean input is not x^2 (pow or x * x)", square)
    expect(core.scaled is x, "the inverse root scales a different tensor than the one squared", core.normed)
    return x, core.normed, eps


def rms_norm_via_aten(node: fx.Node) -> RmsNormMatch:
    args = call_args(node)
    x, dims, weight, eps = args["input"], list(args["normalized_shape"]), args["weight"], args["eps"]
    shape = list(val(x).shape)
    expect(len(dims) == 1 and shape[-1:] == dims, f"normalized over {dims} of {shape}, expected the last dim", node)
    dtype = val(x).dtype
    if eps is None:  # what aten.rms_norm itself uses
        eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    expect(scalar(eps) is not None, "eps is not a constant", node)
    return RmsNormMatch(x, weight, 0.0, scalar(eps), node, upcast=dtype in (torch.float16, torch.bfloat16))


def match_weight(normed: fx.Node) -> tuple[fx.Node | None, float, fx.Node]:
    """The optional ``* w`` or ``* (1 + w)`` after the normalisation (through a cast)."""
    out = normed
    if len(out.users) == 1 and is_cast(next(iter(out.users))):
        out = next(iter(out.users))
    if len(out.users) != 1:
        return None, 0.0, out
    user = next(iter(out.users))
    if not is_op(user, aten.mul.Tensor):
        return None, 0.0, out
    _, weight = commuted(user, lambda n: n is out, "the normalised value")
    hidden = val(normed).shape[-1]
    if not isinstance(weight, fx.Node) or tuple(val(weight).shape) != (hidden,):
        return None, 0.0, out  # a scale of another shape is not the norm's weight
    offset = 0.0
    if is_op(weight, aten.add.Tensor) and scalar(weight.args[1]) is not None:
        offset, weight = scalar(weight.args[1]), weight.args[0]
    return weight, offset, user


class FuseRmsNorm(PatternPass):
    name = "fuse_rms_norm"
    summary = "x * rsqrt(mean(x^2) + eps) * w (or x / sqrt, x * pow(-0.5), 1 / sqrt) -> graphopt.rms_norm"
    anchors = (*INVERSE_ROOT, aten.rms_norm.default)

    def screen(self, root: fx.Node) -> str | None:
        # Every x.pow(2) is an anchor too: only pow(v, -0.5) is an inverse root.
        if root.target is aten.pow.Tensor_Scalar and scalar(root.args[1]) != -0.5:
            return f"pow(x, {root.args[1]}) is no inverse square root (only pow(v, -0.5) is)"
        return None

    def match(self, root: fx.Node, options) -> RmsNormMatch:
        if root.target is aten.rms_norm.default:
            return rms_norm_via_aten(root)
        squared, normed, eps = match_rms_core(root)
        weight, offset, output = match_weight(normed)
        x = squared
        # Upcast in, downcast out to the same dtype: the op does exactly that inside, so it
        # may read the narrow tensor. Walk up only as far as that dtype, through exact upcasts.
        cast_back = next(iter(normed.users)) if output is not normed else None
        if cast_back is not None and is_cast(cast_back):
            want, node = val(cast_back).dtype, squared
            while is_cast(node) and is_exact_upcast(val(node.args[0]).dtype, val(node).dtype):
                node = node.args[0]
                if val(node).dtype == want:
                    x = node
                    break
        return RmsNormMatch(x, weight, offset, eps, output)

    def rewrite(self, gm: fx.GraphModule, m: RmsNormMatch, options) -> None:
        graph = gm.graph
        with graph.inserting_before(m.output):
            x, weight = m.x, m.weight
            if m.upcast:
                x = graph.call_function(aten._to_copy.default, (x,), {"dtype": torch.float32})
                ir.infer_val(x)  # cast_like infers the op's value from its inputs'
                if weight is not None and val(weight).dtype != torch.float32:
                    weight = graph.call_function(aten._to_copy.default, (weight,), {"dtype": torch.float32})
                    ir.infer_val(weight)
            fused = graph.call_function(torch.ops.graphopt.rms_norm.default, (x, weight, m.eps, m.weight_offset))
            result = cast_like(gm, fused, m.output)
        m.output.replace_all_uses_with(result)


fuse_rms_norm = FuseRmsNorm()
