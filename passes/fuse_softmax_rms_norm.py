"""Softmax + RMSNorm: ``graphopt.rms_norm(softmax(x, -1), w, eps)  ->
graphopt.softmax_rms_norm(x, w, eps)``.

Why: both reduce over the last axis, so one kernel can hold the row, take its max, sum
and sum of squares, and write the normalised probabilities once, instead of writing the
probabilities and reading them back (router / gating heads that normalise their
probabilities before scaling experts).

Runs after fuse_rms_norm and matches its ``graphopt.rms_norm`` node. Spellings matched:
``aten._softmax`` and ``aten.softmax.int``; casts around the softmax as long as the op's
rounding reproduces them: the op computes the softmax in float32 and rounds the
probabilities to its input's dtype, so ``softmax(x.float()).to(x.dtype)`` (the Hugging Face
router spelling) and ``_softmax(x, -1, half_to_float=True).to(x.dtype)`` fuse to ``x``.
Preconditions: the softmax reduces the last axis (the norm always does); the
probabilities and every cast between them and the norm have no other user; the
probabilities are rounded to one dtype the op's input can carry; a norm that reads them
upcast (f16 -> f32) must have its result cast back to that dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.rewrite import (
    FLOAT_BITS, SOFTMAX_OPS, call_args, cast_back_user, cast_like, dtype_name, expect, is_cast,
    is_exact_upcast, is_last_dim, is_op, NoMatch, PatternPass, scalar, val,
)

aten = torch.ops.aten



# --- the pass ---------------------------------------------------------------------------

@dataclass
class SoftmaxRmsNormMatch:
    x: fx.Node  # the softmax input the fused op reads
    weight: fx.Node | None
    eps: float
    weight_offset: float
    output: fx.Node  # the node whose value the fused op replaces


def _through_casts(node: Any) -> tuple[list[fx.Node], Any]:
    """(the dtype casts above ``node``, nearest first; the value they start from)."""
    casts = []
    while is_cast(node):
        casts.append(node)
        node = node.args[0]
    return casts, node


def _softmax_upcast(sm: fx.Node) -> torch.dtype | None:
    """The dtype a softmax converts its input to before reducing, if it does."""
    in_dtype = val(sm.args[0]).dtype
    if sm.target is aten._softmax.default:
        return val(sm).dtype if sm.args[2] else None
    dtype = sm.args[2] if len(sm.args) > 2 else sm.kwargs.get("dtype")
    return dtype if dtype is not None and dtype != in_dtype else None


def _rounding_dtype(sm: fx.Node, casts: list[fx.Node]) -> torch.dtype:
    """The one dtype the probabilities are rounded to between the softmax and the norm."""
    chain = [val(sm).dtype] + [val(c).dtype for c in reversed(casts)]
    narrow = {d for d in chain if FLOAT_BITS.get(d) == 16}
    expect(all(d in FLOAT_BITS for d in chain), "probabilities are not floating point", sm)
    expect(torch.float64 not in chain, "float64 probabilities; softmax_rms_norm computes in float32", sm)
    expect(len(narrow) <= 1, "probabilities are rounded to both float16 and bfloat16", sm)
    return narrow.pop() if narrow else torch.float32


class FuseSoftmaxRmsNorm(PatternPass):
    name = "fuse_softmax_rms_norm"
    summary = "graphopt.rms_norm(softmax(x, -1)) -> graphopt.softmax_rms_norm(x)"
    requires = ("fuse_rms_norm",)
    anchors = (torch.ops.graphopt.rms_norm.default,)

    def screen(self, norm: fx.Node) -> str | None:
        # Only norms that read a softmax are candidates: every other norm (all of Llama's)
        # is screened out, so --why shows them as one grouped line, not as near misses.
        if is_op(_through_casts(call_args(norm)["x"])[1], *SOFTMAX_OPS):
            return None
        return "the norm's input is no softmax"

    def match(self, norm: fx.Node, options) -> SoftmaxRmsNormMatch:
        args = call_args(norm)
        probs = args["x"]
        casts, sm = _through_casts(probs)
        if not is_op(sm, *SOFTMAX_OPS):
            found = ir.target_name(sm.target) if isinstance(sm, fx.Node) else repr(sm)
            raise NoMatch(f"norm input: expected aten._softmax or aten.softmax, found {found}",
                          sm if isinstance(sm, fx.Node) else None)
        x, dim = sm.args[0], sm.args[1]
        expect(is_last_dim(dim, x), f"softmax over dim {dim}, norm over -1", sm)
        # the fused op does not return the probabilities, so nobody else may read them
        expect(len(sm.users) == 1, f"softmax result {sm.name} has {len(sm.users)} users; "
                                   "softmax_rms_norm does not return the probabilities", sm)
        for cast in casts:
            expect(len(cast.users) == 1, f"cast {cast.name} of the probabilities has {len(cast.users)} users", cast)

        upcast = _softmax_upcast(sm)
        if upcast is not None:
            expect(is_exact_upcast(val(x).dtype, upcast),
                   f"softmax casts its input {dtype_name(val(x).dtype)} -> {dtype_name(upcast)} first", sm)
        rounded = _rounding_dtype(sm, casts)
        # The op rounds the float32 probabilities to its input's dtype: find an input of the
        # rounding dtype holding x's exact values (x itself, or x before exact upcasts).
        source = x
        while val(source).dtype != rounded and is_cast(source) and \
                is_exact_upcast(val(source.args[0]).dtype, val(source).dtype):
            source = source.args[0]
        if val(source).dtype != rounded:
            if upcast is not None and rounded == upcast:
                how = "half_to_float" if sm.target is aten._softmax.default else f"dtype={dtype_name(upcast)}"
                raise NoMatch(f"softmax upcasts {dtype_name(val(x).dtype)} -> {dtype_name(upcast)} "
                              f"({how}) and the norm reads {dtype_name(upcast)} probabilities; "
                              f"softmax_rms_norm would round them to {dtype_name(val(x).dtype)}", sm)
            raise NoMatch(f"probabilities are rounded to {dtype_name(rounded)} but the softmax reads "
                          f"{dtype_name(val(x).dtype)}; softmax_rms_norm rounds them to its input's dtype", sm)

        output = norm
        read = val(probs).dtype
        if read != rounded:  # the norm reads upcast probabilities: fine if its result goes back down
            output = cast_back_user(norm, rounded)
            expect(output is not None,
                   f"norm reads {dtype_name(rounded)} probabilities upcast to {dtype_name(read)} and its result "
                   f"is not cast back; softmax_rms_norm would round the normalised value to {dtype_name(rounded)}",
                   norm)
        eps = scalar(args["eps"])
        expect(eps is not None, "eps is not a constant", norm)
        return SoftmaxRmsNormMatch(source, args["weight"], eps, scalar(args["weight_offset"]) or 0.0, output)

    def rewrite(self, gm: fx.GraphModule, m: SoftmaxRmsNormMatch, options) -> None:
        with gm.graph.inserting_before(m.output):
            fused = gm.graph.call_function(
                torch.ops.graphopt.softmax_rms_norm.default, (m.x, m.weight, m.eps, m.weight_offset))
            result = cast_like(gm, fused, m.output)
        m.output.replace_all_uses_with(result)


fuse_softmax_rms_norm = FuseSoftmaxRmsNorm()
