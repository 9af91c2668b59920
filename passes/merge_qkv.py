"""Merged QKV projection: ``q = x @ Wq^T + bq; k = x @ Wk^T + bk; v = x @ Wv^T + bv  ->
q, k, v = graphopt.qkv_proj(x, cat([Wq, Wk, Wv]), cat([bq, bk, bv]), [Nq, Nk, Nv])``,
the concatenated weight and bias being new frozen constants.

Why: one GEMM reads the activations once and fills the machine better than three
narrow ones (k and v are narrow under grouped-query attention); ORT and TensorRT lower
it to one MatMul + Split, Triton to one kernel.

Which linears are merged (model-agnostic, no parameter names): the linear layers
(``aten.mm``/``addmm``/``linear`` against a transposed weight) that read the same input
x, directly or through aot's flattening ``view(x, [M, K])``, and whose outputs are split
into attention heads (a view of the [..., N] output to [..., H, D] with H * D = N). At
least 3 of them are needed: q, k and v. The head split is what tells the attention
projections apart from the other linears of a block: a gated MLP's gate/up pair (which
also shares an input) and the MLP of a parallel block (GPT-J, Falcon) are not split
into heads and stay plain linears (for fuse_gated_mlp and INT4 quantization); k/v of a
cross-attention (2 linears) are left alone too. So the pass does not depend on the order
relative to fuse_gated_mlp.

Preconditions: every merged weight (and bias) is a frozen constant of one dtype; all
GEMMs read x with the same shape (the same K); widths may differ (GQA); a missing bias
counts as zeros when another projection has one.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from graphopt.linears import (
    Linear, concat_params, expect_constant_params, expect_same_params, input_mismatch,
    match_linear,
)
from graphopt.rewrite import GEMM_OPS, VIEW_OPS, NoMatch, PatternPass, expect, is_op, val

aten = torch.ops.aten


@dataclass
class QkvMatch:
    x: fx.Node
    linears: list[Linear]  # in graph order


def splits_into_heads(lin: Linear) -> bool:
    """Some user views the [..., N] output as [..., H, D] with H * D = N (H = 1 for MQA's k, v)."""
    for user in lin.out.users:
        shape = val(user).shape if is_op(user, *VIEW_OPS) else None
        if shape is not None and len(shape) >= 3 and shape[-2] * shape[-1] == lin.width:
            return True
    return False


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


def _is_head_projection(gemm: fx.Node) -> bool:
    try:
        return splits_into_heads(match_linear(gemm, "linear"))
    except NoMatch:
        return False


class MergeQkv(PatternPass):
    name = "merge_qkv"
    summary = "q/k/v linears of one input -> graphopt.qkv_proj over concatenated weights"
    anchors = GEMM_OPS

    def candidates(self, gm: fx.GraphModule) -> list[fx.Node]:
        # One anchor per input: the first linear of it that is split into heads. Linears that
        # are not attention projections (MLP, o_proj, lm_head) would only add noise.
        seen, anchors = set(), []
        for gemm in super().candidates(gm):
            if not _is_head_projection(gemm):
                continue
            x = match_linear(gemm, "linear").source
            if x not in seen:
                seen.add(x)
                anchors.append(gemm)
        return anchors

    def match(self, anchor: fx.Node, options) -> QkvMatch:
        x = match_linear(anchor, "linear").source
        linears = [lin for lin in linears_reading(x) if splits_into_heads(lin)]
        expect(len(linears) >= 3, f"only {len(linears)} linear(s) split into heads read {x.name}; "
               "q, k and v must read the same input", anchor)
        first = linears[0]
        for lin in linears[1:]:
            expect(lin.spelling == first.spelling, f"{lin.gemm.name} and {first.gemm.name} are spelled differently",
                   lin.gemm)
            mismatch = input_mismatch(first, lin, first.gemm.name, lin.gemm.name)
            expect(mismatch is None, mismatch, lin.gemm)
        names = [f"projection {lin.gemm.name}" for lin in linears]
        for lin, name in zip(linears, names):
            expect_constant_params(lin, name)
        expect_same_params(linears, names)
        return QkvMatch(x, linears)

    def rewrite(self, gm: fx.GraphModule, m: QkvMatch, options) -> None:
        graph, first = gm.graph, m.linears[0]
        sizes = [lin.width for lin in m.linears]
        with graph.inserting_before(first.gemm):
            weight, bias = concat_params(gm, m.linears)
            # The 2-D input for mm-style graphs (the views back to [..., N] stay), x for aten.linear.
            qkv = graph.call_function(torch.ops.graphopt.qkv_proj.default, (first.x2d, weight, bias, sizes))
            parts = [graph.call_function(operator.getitem, (qkv, i)) for i in range(len(sizes))]
        for lin, part in zip(m.linears, parts):
            lin.gemm.replace_all_uses_with(part)


merge_qkv = MergeQkv()
