"""RMSNorm: ``x * rsqrt(mean(x^2, -1) + eps) * w  ->  graphopt.rms_norm(x, w, eps)``.

Why: the decomposed form reads the row three times and writes four temporaries; the
fused op reads it once (a Triton kernel, ORT's SimplifiedLayerNormalization).

Spellings matched: ``x.pow(2)`` or ``x * x`` for the square; a float32 upcast of x
and a downcast of the result around it (Hugging Face); the weight on either side of
the multiply; ``(1 + w)`` scaling (Gemma), carried as ``weight_offset``; no weight.
Preconditions: the mean reduces the last axis with keepdim; eps is a constant; the
rsqrt scales the same tensor that was squared; every intermediate has one user.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from graphopt.rewrite import (
    ADD_OPS, cast_like, expect, expect_op, is_cast, is_exact_upcast, is_last_dim, is_op, NoMatch, only_user,
    PatternPass, scalar, single_use, val,
)

aten = torch.ops.aten


@dataclass
class RmsNormMatch:
    x: fx.Node  # the input the fused op reads
    weight: fx.Node | None
    weight_offset: float
    eps: float
    output: fx.Node  # the node whose value the fused op replaces


def match_rms_core(rsqrt: fx.Node) -> tuple[fx.Node, fx.Node, float]:
    """From ``rsqrt(mean(x^2) + eps)`` return (x_squared, normed = x * rsqrt, eps)."""
    add = single_use(expect_op(rsqrt.args[0], ADD_OPS, "rsqrt input"), "variance + eps")
    mean, eps = add.args[0], scalar(add.args[1])
    if eps is None and isinstance(add.args[1], fx.Node):  # eps + mean written the other way round
        mean, eps = add.args[1], scalar(add.args[0])
    expect(eps is not None, "eps is not a constant", add)
    single_use(expect_op(mean, aten.mean.dim, "variance"), "mean")
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
    normed = only_user(rsqrt, "rsqrt")
    expect_op(normed, aten.mul.Tensor, "rsqrt user")
    other = normed.args[0] if normed.args[1] is rsqrt else normed.args[1]
    expect(other is x, "rsqrt scales a different tensor than the one squared", normed)
    return x, normed, eps


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
    weight = user.args[0] if user.args[1] is out else user.args[1]
    hidden = val(normed).shape[-1]
    if not isinstance(weight, fx.Node) or tuple(val(weight).shape) != (hidden,):
        return None, 0.0, out  # a scale of another shape is not the norm's weight
    offset = 0.0
    if is_op(weight, aten.add.Tensor) and scalar(weight.args[1]) is not None:
        offset, weight = scalar(weight.args[1]), weight.args[0]
    return weight, offset, user


class FuseRmsNorm(PatternPass):
    name = "fuse_rms_norm"
    summary = "x * rsqrt(mean(x^2) + eps) * w -> graphopt.rms_norm"
    anchors = (aten.rsqrt.default,)

    def match(self, rsqrt: fx.Node, options) -> RmsNormMatch:
        squared, normed, eps = match_rms_core(rsqrt)
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
        with gm.graph.inserting_before(m.output):
            fused = gm.graph.call_function(
                torch.ops.graphopt.rms_norm.default, (m.x, m.weight, m.eps, m.weight_offset))
            result = cast_like(gm, fused, m.output)
        m.output.replace_all_uses_with(result)


fuse_rms_norm = FuseRmsNorm()
