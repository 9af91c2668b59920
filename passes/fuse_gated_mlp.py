"""Gated MLP: ``act(x @ Wg^T + bg) * (x @ Wu^T + bu)  ->  graphopt.swiglu(x @ Wgu^T + bgu)``
(act = silu) or ``graphopt.geglu(..., approximate)`` (act = gelu, erf or tanh), with
``Wgu = cat([Wg, Wu], 0)`` and ``bgu = cat([bg, bu])`` new frozen constants.

Why: one GEMM over the concatenated weights reads x once instead of twice and launches
one kernel instead of two; the activation and the product become one elementwise op
(a Triton kernel) instead of three passes over the [tokens, intermediate] activations.

The merged GEMM keeps the spelling the frontend used (``aten.t`` + ``aten.mm``/``addmm``
with the flattening views, or ``aten.linear`` from torch.export), so later passes that
match a plain linear against a constant weight (INT4 quantization) still see one.

Spellings matched: ``act(gate) * up`` and ``up * act(gate)``; either projection with or
without a bias (a missing one counts as zeros). Preconditions: both GEMMs read the same
input (the same node, or views of it with the same shape); both weights (and biases) are
frozen constants with the same K and dtype; gate and up have the same width; the gate
output, its activation and the up output have no other users.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.linears import (
    Linear, concat_params, expect_constant_params, expect_same_params, input_mismatch, linear_producing, same_shape,
)
from graphopt.rewrite import (
    GATE_ACTIVATION_OPS, expect, is_op, NoMatch, PatternPass, val,
)

aten = torch.ops.aten

# --- The gated MLP.



@dataclass
class GatedMlpMatch:
    product: fx.Node  # act(gate) * up: the value the fused op replaces
    act: fx.Node
    gate: Linear
    up: Linear


class FuseGatedMlp(PatternPass):
    name = "fuse_gated_mlp"
    summary = "act(x @ Wg^T) * (x @ Wu^T) -> graphopt.swiglu/geglu(x @ cat(Wg, Wu)^T)"
    anchors = (aten.mul.Tensor,)

    def candidates(self, gm: fx.GraphModule) -> list[fx.Node]:
        # Only products with a silu/gelu operand: near misses on every other mul would be noise.
        return [n for n in super().candidates(gm) if any(is_op(a, *GATE_ACTIVATION_OPS) for a in n.args[:2])]

    def match(self, product: fx.Node, options) -> GatedMlpMatch:
        first, second = product.args[:2]
        if is_op(first, *GATE_ACTIVATION_OPS):
            try:
                return self._match_ordered(product, first, second)
            except NoMatch:
                if not is_op(second, *GATE_ACTIVATION_OPS):
                    raise
        return self._match_ordered(product, second, first)  # up * act(gate)

    def _match_ordered(self, product: fx.Node, act: fx.Node, up_out: fx.Node) -> GatedMlpMatch:
        expect(len(act.users) == 1, f"gate activation has {len(act.users)} users", act)
        if act.target is aten.gelu.default:
            approximate = act.kwargs.get("approximate", "none")
            expect(approximate in ("none", "tanh"), f"gelu approximate={approximate!r}", act)
        gate_out = act.args[0]
        expect(isinstance(gate_out, fx.Node) and isinstance(up_out, fx.Node), "operands are not graph values", product)
        expect(len(gate_out.users) == 1, f"gate output has {len(gate_out.users)} users", gate_out)
        expect(len(up_out.users) == 1, f"up output has {len(up_out.users)} users", up_out)
        gate = linear_producing(gate_out, "gate projection")
        up = linear_producing(up_out, "up projection")
        mismatch = input_mismatch(gate, up, "gate", "up")
        expect(mismatch is None, mismatch, up.x2d)
        expect(gate.spelling == up.spelling, f"gate is spelled {ir.target_name(gate.gemm.target)}, "
               f"up {ir.target_name(up.gemm.target)}", up.gemm)
        expect_constant_params(gate, "gate projection")
        expect_constant_params(up, "up projection")
        expect(gate.width == up.width, f"gate width {gate.width} != up width {up.width}", up.gemm)
        expect(same_shape(val(gate_out), val(up_out)) and same_shape(val(gate_out), val(product)),
               "the product broadcasts", product)
        expect_same_params([gate, up], ["gate projection", "up projection"])
        return GatedMlpMatch(product, act, gate, up)

    def rewrite(self, gm: fx.GraphModule, m: GatedMlpMatch, options) -> None:
        graph, gate = gm.graph, m.gate
        with graph.inserting_before(m.product):
            weight, bias = concat_params(gm, [gate, m.up])
            if gate.spelling == "linear":
                args = (gate.x2d, weight) if bias is None else (gate.x2d, weight, bias)
                gate_up = graph.call_function(aten.linear.default, args)
            else:
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
            if m.act.target is aten.silu.default:
                fused = graph.call_function(torch.ops.graphopt.swiglu.default, (gate_up,))
            else:
                approximate = m.act.kwargs.get("approximate", "none")
                fused = graph.call_function(torch.ops.graphopt.geglu.default, (gate_up, approximate))
        m.product.replace_all_uses_with(fused)


fuse_gated_mlp = FuseGatedMlp()
