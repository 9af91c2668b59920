"""Merged QKV projection: ``q = x @ Wq^T + bq; k = x @ Wk^T + bk; v = x @ Wv^T + bv  ->
q, k, v = graphopt.qkv_proj(x, W, b, [Nq, Nk, Nv])``, one GEMM whose output is split.

Why: one GEMM reads the activations once and fills the machine better than three
narrow ones (k and v are narrow under grouped-query attention); ORT and TensorRT lower
it to one MatMul + slices, Triton to one kernel. Downstream, attention sees q, k and v
exactly as before (the op's outputs are what the views into heads read).

Spellings matched, named by where q, k and v come from:
- ``qkv_via_separate_projections``: three (or more) linears of one input. ``W = cat([Wq,
  Wk, Wv])`` and ``b = cat([bq, bk, bv])`` are new frozen constants; a missing bias counts
  as zeros when another projection has one. The pass anchors on the first of them.
- ``qkv_via_merged_projection``: one linear already holding q, k and v (Phi3's
  ``qkv_proj``, merged checkpoints) whose output is cut into them by slicing or
  ``split``: ``qkv_proj`` reads that weight as it is, with the cut's widths.

Which linears are attention projections (model-agnostic, no parameter names): those whose
output (or each piece of it) is split into heads, a view of the [..., N] output to
[..., H, D] with H * D = N. At least 3 are needed: q, k and v. That is what tells them
apart from the other linears of a block: a gated MLP's gate/up pair (which also shares an
input, or is one projection cut in two) and the MLP of a parallel block (GPT-J, Falcon)
are not split into heads and stay for fuse_gated_mlp and INT4 quantization; k/v of a
cross-attention (2 linears) are left alone too. So the pass does not depend on the order
relative to fuse_gated_mlp.

Preconditions: separate projections: every merged weight (and bias) is a frozen constant
of one dtype; all GEMMs read x with the same shape (the same K); widths may differ (GQA).
A merged projection: it is read only through pieces that tile its last axis, each split
into heads, and the pieces keep x's leading dims.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from graphopt.rewrite import (
    GEMM_OPS, SPLIT_OPS, VIEW_OPS, NoMatch, PatternPass, expect, is_op, last_dim_pieces, same_leading_dims, val,
)
from graphopt.rewrite.linears import (
    Linear, concat_params, expect_constant_params, expect_same_params, input_mismatch,
    match_linear,
)

aten = torch.ops.aten


@dataclass
class QkvMatch:
    x: fx.Node  # what qkv_proj reads
    linears: list[Linear]  # in graph order; one when it is already merged
    outputs: list[fx.Node]  # the values q, k, v (...) replace, in the weight's row order
    sizes: list[int]


def views_into_heads(value: fx.Node, width: int) -> bool:
    """Some user views ``value`` ([..., N]) as [..., H, D] with H * D = N (H = 1 for MQA's k, v)."""
    for user in value.users:
        shape = val(user).shape if is_op(user, *VIEW_OPS) else None
        if shape is not None and len(shape) >= 3 and shape[-2] * shape[-1] == width:
            return True
    return False


def splits_into_heads(lin: Linear) -> bool:
    return views_into_heads(lin.out, lin.width)


def linears_reading(x: fx.Node) -> list[Linear]:
    """Every linear layer whose GEMM reads x, directly or through a view, in graph order."""
    gemms = [u for u in x.users if is_op(u, *GEMM_OPS)]
    gemms += [g for u in x.users if is_op(u, *VIEW_OPS) for g in u.users if is_op(g, *GEMM_OPS)]
    found = []
    for gemm in dict.fromkeys(gemms):
        try:
            lin = match_linear(gemm, "linear")
        except NoMatch:
            continue  # x as the weight side of a product, or not a linear at all
        if lin.source is x:
            found.append(lin)
    order = {n: i for i, n in enumerate(x.graph.nodes)}
    return sorted(found, key=lambda lin: order[lin.gemm])


def has_head_pieces(lin: Linear) -> bool:
    """Some slice or split piece of the output is split into heads (a merged projection)."""
    pieces = [u for u in lin.out.users if is_op(u, aten.slice.Tensor)]
    pieces += [g for u in lin.out.users if is_op(u, *SPLIT_OPS) for g in u.users]
    return any(isinstance(val(p), torch.Tensor) and views_into_heads(p, val(p).shape[-1]) for p in pieces)


def qkv_via_separate_projections(first: Linear) -> QkvMatch:
    x = first.source
    linears = [lin for lin in linears_reading(x) if splits_into_heads(lin)]
    expect(len(linears) >= 3, f"only {len(linears)} linear(s) split into heads read {x.name}; "
           "q, k and v must read the same input", first.gemm)
    for lin in linears[1:]:
        expect(lin.spelling == first.spelling, f"{lin.gemm.name} and {first.gemm.name} are spelled differently",
               lin.gemm)
        mismatch = input_mismatch(first, lin, first.gemm.name, lin.gemm.name)
        expect(mismatch is None, mismatch, lin.gemm)
    names = [f"projection {lin.gemm.name}" for lin in linears]
    for lin, name in zip(linears, names):
        expect_constant_params(lin, name)
    expect_same_params(linears, names)
    # The 2-D input for mm-style graphs (the views back to [..., N] stay), x for aten.linear.
    return QkvMatch(first.x2d, linears, [lin.gemm for lin in linears], [lin.width for lin in linears])


def qkv_via_merged_projection(lin: Linear) -> QkvMatch:
    pieces = last_dim_pieces(lin.out, "merged projection")
    expect(len(pieces) >= 3, f"merged projection {lin.out.name} is cut in {len(pieces)} pieces, "
           "expected q, k and v", lin.out)
    # qkv_proj returns [..., n] pieces of its input's leading dims: read x before aot's
    # flattening view when the pieces are cut from the view back to [..., N].
    x = lin.source if lin.out is not lin.gemm else lin.x2d
    expect(same_leading_dims(val(x), val(lin.out)),
           f"merged projection {lin.out.name} is {list(val(lin.out).shape)}, its input {x.name} "
           f"{list(val(x).shape)}: qkv_proj keeps the input's leading dims", lin.out)
    return QkvMatch(x, [lin], [p.node for p in pieces], [p.width for p in pieces])


class MergeQkv(PatternPass):
    name = "merge_qkv"
    summary = "q/k/v linears of one input, or one linear cut into them -> graphopt.qkv_proj"
    anchors = GEMM_OPS

    def screen(self, gemm: fx.Node) -> str | None:
        # One anchor per input (its first head projection), or a merged projection: the MLP,
        # o_proj and lm_head are no candidates.
        try:
            lin = match_linear(gemm, "linear")
        except NoMatch as miss:
            return miss.reason
        if splits_into_heads(lin):
            first = next(f for f in linears_reading(lin.source) if splits_into_heads(f))
            if first.gemm is not gemm:
                return f"merged from the first head projection of its input ({first.gemm.name})"
            return None
        if not has_head_pieces(lin):
            return "output is not split into attention heads"
        return None

    def match(self, anchor: fx.Node, options) -> QkvMatch:
        lin = match_linear(anchor, "linear")
        if splits_into_heads(lin):
            return qkv_via_separate_projections(lin)
        return qkv_via_merged_projection(lin)

    def rewrite(self, gm: fx.GraphModule, m: QkvMatch, options) -> None:
        graph, first = gm.graph, m.linears[0]
        with graph.inserting_before(first.gemm):
            if len(m.linears) == 1:  # already merged: read its weight and bias as they are
                weight, bias = first.weight, first.bias
            else:
                weight, bias = concat_params(gm, m.linears)
            qkv = graph.call_function(torch.ops.graphopt.qkv_proj.default, (m.x, weight, bias, m.sizes))
            parts = [graph.call_function(operator.getitem, (qkv, i)) for i in range(len(m.sizes))]
        for output, part in zip(m.outputs, parts):
            output.replace_all_uses_with(part)


merge_qkv = MergeQkv()
