"""Gated MLP: ``act(gate) * up  ->  graphopt.swiglu(gate_up)`` (act = silu) or
``graphopt.geglu(gate_up, approximate)`` (act = gelu, erf or tanh), ``gate_up`` being one
GEMM's output whose first half is the gate and second half the up projection.

Why: one GEMM over the concatenated weights reads x once instead of twice and launches
one kernel instead of two; the activation and the product become one elementwise op
(a Triton kernel) instead of three passes over the [tokens, intermediate] activations.

Spellings matched, named by where gate and up come from:
- ``gated_mlp_via_two_projections``: ``act(x @ Wg^T + bg) * (x @ Wu^T + bu)`` (Llama,
  Gemma): the two GEMMs become one over ``Wgu = cat([Wg, Wu])`` (and ``bgu``), new frozen
  constants. The merged GEMM keeps the spelling the frontend used (``aten.t`` +
  ``aten.mm``/``addmm`` with the flattening views, or ``aten.linear`` from torch.export),
  so later passes that match a plain linear against a constant weight (INT4) still see one.
  A missing bias counts as zeros.
- ``gated_mlp_via_merged_projection``: one projection cut in two halves (``gate_up_proj``
  then ``chunk``/``split``/slicing, as Phi3 and merged checkpoints do): the fused op reads
  that output as it is. Which half is the gate is read from the graph; when the gate is
  the second half, the rows of the (frozen) projection weight and bias are swapped once so
  that it comes first.
and for both: ``act(gate) * up`` or ``up * act(gate)``; ``silu(g)`` or ``g * sigmoid(g)``
(either order) for SwiGLU.
Preconditions: gate and up have the same shape as the product (no broadcast); the gate
output, its activation and the up output have no other users. Two projections: both read
the same input (the same node, or views of it with the same shape); both weights (and
biases) are frozen constants with the same K and dtype. One projection cut in two: it is
cut in exactly two equal halves and only read through them.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.rewrite import (
    GATE_ACTIVATION_OPS, SPLIT_OPS, NoMatch, PatternPass, expect, is_op, last_dim_pieces, val,
)
from graphopt.rewrite.linears import (
    Linear, concat_params, concat_constant, expect_constant_params, expect_same_params, input_mismatch,
    linear_producing, param_name, same_shape,
)

aten = torch.ops.aten


@dataclass
class GateActivation:
    """``act(gate)``: ``silu``/``gelu`` (one node), or ``gate * sigmoid(gate)`` (two)."""

    output: fx.Node
    gate: fx.Node
    nodes: tuple[fx.Node, ...]  # the activation's own nodes
    kind: str  # "silu" or "gelu"
    approximate: str = "none"


def gate_activation(node: object) -> GateActivation | None:
    """``node`` as a gate activation, or None."""
    if is_op(node, *GATE_ACTIVATION_OPS):
        kind = "silu" if node.target is aten.silu.default else "gelu"
        return GateActivation(node, node.args[0], (node,), kind, node.kwargs.get("approximate", "none"))
    if is_op(node, aten.mul.Tensor):
        for gate, sig in (node.args[:2], node.args[1::-1]):
            if is_op(sig, aten.sigmoid.default) and sig.args[0] is gate:
                return GateActivation(node, gate, (node, sig), "silu")
    return None


@dataclass
class GatedMlpMatch:
    product: fx.Node  # act(gate) * up: the value the fused op replaces
    act: GateActivation
    gate: Linear | None  # two projections
    up: Linear | None
    merged: fx.Node | None = None  # one projection's [..., 2I] output, cut in two
    swap: Linear | None = None  # the merged projection whose halves must trade places


def _piece_of(node: fx.Node) -> fx.Node | None:
    """The tensor ``node`` is a last-axis piece of (a split's getitem or a slice), else None."""
    if is_op(node, aten.slice.Tensor):
        return node.args[0]
    if is_op(node, operator.getitem) and is_op(node.args[0], *SPLIT_OPS):
        return node.args[0].args[0]
    return None


def gated_mlp_via_merged_projection(product: fx.Node, act: GateActivation, up_out: fx.Node) -> GatedMlpMatch:
    merged = _piece_of(act.gate)
    pieces = last_dim_pieces(merged, "merged gate/up projection")
    expect(len(pieces) == 2, f"merged gate/up projection {merged.name} is cut in {len(pieces)} pieces, "
           "expected two halves", merged)
    gate, up = sorted(pieces, key=lambda p: p.node is not act.gate)
    expect(up.node is up_out, f"up {up_out.name} is not the other half of {merged.name}", up_out)
    expect(gate.width == up.width, f"merged gate/up projection {merged.name} is cut in [{gate.start}:{gate.end}] "
           f"and [{up.start}:{up.end}], not two halves", merged)
    swap = None
    if gate.start != 0:  # the op reads the gate first: swap the weight's halves (a frozen constant)
        swap = linear_producing(merged, "merged gate/up projection (gate second)")
        expect_constant_params(swap, "merged gate/up projection (gate second)")
    return GatedMlpMatch(product, act, None, None, merged=merged, swap=swap)


def gated_mlp_via_two_projections(product: fx.Node, act: GateActivation, up_out: fx.Node) -> GatedMlpMatch:
    gate = linear_producing(act.gate, "gate projection", act.nodes)
    up = linear_producing(up_out, "up projection")
    mismatch = input_mismatch(gate, up, "gate", "up")
    expect(mismatch is None, mismatch, up.x2d)
    expect(gate.spelling == up.spelling, f"gate is spelled {ir.target_name(gate.gemm.target)}, "
           f"up {ir.target_name(up.gemm.target)}", up.gemm)
    expect_constant_params(gate, "gate projection")
    expect_constant_params(up, "up projection")
    expect(gate.width == up.width, f"gate width {gate.width} != up width {up.width}", up.gemm)
    expect_same_params([gate, up], ["gate projection", "up projection"])
    return GatedMlpMatch(product, act, gate, up)


class FuseGatedMlp(PatternPass):
    name = "fuse_gated_mlp"
    summary = "act(gate) * up, from two projections or one cut in two -> graphopt.swiglu/geglu(gate_up)"
    anchors = (aten.mul.Tensor,)

    def screen(self, product: fx.Node) -> str | None:
        if not any(gate_activation(a) for a in product.args[:2]):
            return "no silu, gelu or g * sigmoid(g) operand"
        return None

    def match(self, product: fx.Node, options) -> GatedMlpMatch:
        first, second = product.args[:2]
        if gate_activation(first) is not None:
            try:
                return self._match_ordered(product, gate_activation(first), second)
            except NoMatch:
                if gate_activation(second) is None:
                    raise
        return self._match_ordered(product, gate_activation(second), first)  # up * act(gate)

    def _match_ordered(self, product: fx.Node, act: GateActivation, up_out) -> GatedMlpMatch:
        expect(len(act.output.users) == 1, f"gate activation has {len(act.output.users)} users", act.output)
        expect(act.approximate in ("none", "tanh"), f"gelu approximate={act.approximate!r}", act.output)
        expect(isinstance(act.gate, fx.Node) and isinstance(up_out, fx.Node), "operands are not graph values", product)
        outside = len(set(act.gate.users) - set(act.nodes))
        expect(not outside, f"gate output has {outside + 1} users", act.gate)
        expect(len(up_out.users) == 1, f"up output has {len(up_out.users)} users", up_out)
        merged_gate, merged_up = _piece_of(act.gate), _piece_of(up_out)
        if merged_gate is not None and merged_gate is merged_up:
            m = gated_mlp_via_merged_projection(product, act, up_out)
        else:
            expect(merged_gate is None and merged_up is None,
                   f"gate {act.gate.name} and up {up_out.name} are not the two halves of one projection", product)
            m = gated_mlp_via_two_projections(product, act, up_out)
        expect(same_shape(val(act.gate), val(up_out)) and same_shape(val(act.gate), val(product)),
               "the product broadcasts", product)
        return m

    def rewrite(self, gm: fx.GraphModule, m: GatedMlpMatch, options) -> None:
        graph = gm.graph
        with graph.inserting_before(m.product):
            if m.merged is not None:
                if m.swap is not None:
                    _swap_halves(gm, m.swap)
                gate_up = m.merged
            else:
                gate_up = _merged_gemm(gm, m.gate, m.up)
            if m.act.kind == "silu":
                fused = graph.call_function(torch.ops.graphopt.swiglu.default, (gate_up,))
            else:
                fused = graph.call_function(torch.ops.graphopt.geglu.default, (gate_up, m.act.approximate))
        m.product.replace_all_uses_with(fused)


def _merged_gemm(gm: fx.GraphModule, gate: Linear, up: Linear) -> fx.Node:
    """One GEMM over cat([Wg, Wu]) (and the biases), spelled as ``gate`` was."""
    graph = gm.graph
    weight, bias = concat_params(gm, [gate, up])
    if gate.spelling == "linear":
        args = (gate.x2d, weight) if bias is None else (gate.x2d, weight, bias)
        return graph.call_function(aten.linear.default, args)
    weight_t = graph.call_function(aten.t.default, (weight,))
    if bias is None:
        gate_up = graph.call_function(aten.mm.default, (gate.x2d, weight_t))
    else:
        gate_up = graph.call_function(aten.addmm.default, (bias, gate.x2d, weight_t))
    if gate.out is not gate.gemm:  # the view back to [..., 2N]
        shape = list(gate.out.args[1])
        if shape[-1] != -1:
            shape[-1] = 2 * gate.width
        gate_up = graph.call_function(gate.out.target, (gate_up, shape))
    return gate_up


def _swap_halves(gm: fx.GraphModule, lin: Linear) -> None:
    """Point ``lin`` at a copy of its weight (and bias) with the two row halves swapped."""
    for param in (lin.weight, lin.bias):
        if param is None:
            continue
        tensor = ir.get_constant(param)
        half = tensor.shape[0] // 2
        with gm.graph.inserting_after(param):
            swapped = concat_constant(gm, [tensor[half:], tensor[:half]], param_name(param) + ".gate_first")
        user = lin.gemm if param is lin.bias or lin.spelling == "linear" else lin.gemm.args[-1]
        user.replace_input_with(param, swapped)


fuse_gated_mlp = FuseGatedMlp()
