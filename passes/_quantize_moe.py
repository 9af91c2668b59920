"""The mixture-of-experts part of ``quantize_int4``:

1. ``graphopt.moe(x, Wr, gate_up, down, k, norm, Wsgu, Wsd, Wsg)``  ->
   ``graphopt.moe(x, Wr, gate_up, down, k, norm) + [sigmoid(x @ Wsg^T) *]
   mm(swiglu(mm(x, t(Wsgu))), t(Wsd))``, before the linears are quantized: the shared
   expert is a dense MLP every token runs, so its two GEMMs become ordinary linears that
   the pass quantizes (and calibrates, and lets ``skip`` / ``budget`` choose for) like any
   other. Its 1 x hidden sigmoid gate is written as a matrix-vector product, which the
   linear matcher leaves in full precision: 4 bits would save nothing there.
2. ``graphopt.moe(x, Wr, gate_up, down, k, norm)``  ->  ``graphopt.int4_moe(x, Wr,
   Q(gate_up), Q(down), group_size, k, norm)``, every expert's rows quantized group-wise
   along K in the ``int4_linear`` format (graphopt/ops/moe_int4.py). Experts are
   quantized by round-to-nearest (``search="mse"``: the weight-error search) whatever
   ``search`` says: GPTQ would need each expert's own routed activations, which the
   calibration run does not split out. The router stays in full precision (routing
   decisions flip on small logit changes).
"""

from __future__ import annotations

import fnmatch
from typing import Any, Callable

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.quant import groupwise
from graphopt.rewrite import val
from graphopt.rewrite.linears import param_name

aten = torch.ops.aten
graphopt = torch.ops.graphopt
PASS = "quantize_int4"


def _moe_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is graphopt.moe.default]


def _call(gm: fx.GraphModule, target: Any, args: tuple, like: fx.Node) -> fx.Node:
    node = gm.graph.call_function(target, args)
    node.meta.update({k: like.meta[k] for k in ("stack_trace", "nn_module_stack") if k in like.meta})
    node.meta[ir.CREATED_BY] = PASS
    ir.infer_val(node)
    return node


def split_shared_experts(gm: fx.GraphModule) -> int:
    """Step 1 of the module docstring, in place; returns how many shared experts moved out."""
    moved = 0
    for node in _moe_nodes(gm):
        args = list(node.args) + [None] * (9 - len(node.args))
        x, (shared_gate_up, shared_down, shared_gate) = args[0], args[6:9]
        if shared_gate_up is None:
            continue
        with gm.graph.inserting_before(node.next):  # in order, right after the moe
            node.args = tuple(node.args[:6])
            ir.infer_val(node)
            hidden = _call(gm, graphopt.swiglu.default,
                           (_call(gm, aten.mm.default, (x, _call(gm, aten.t.default, (shared_gate_up,), node)), node),),
                           node)
            shared = _call(gm, aten.mm.default, (hidden, _call(gm, aten.t.default, (shared_down,), node)), node)
            if shared_gate is not None:  # [T, H] @ [H] -> [T] -> [T, 1]
                row = _call(gm, aten.select.int, (shared_gate, 0, 0), node)
                logit = _call(gm, aten.unsqueeze.default, (_call(gm, aten.mv.default, (x, row), node), -1), node)
                shared = _call(gm, aten.mul.Tensor, (_call(gm, aten.sigmoid.default, (logit,), node), shared), node)
            total = _call(gm, aten.add.Tensor, (node, shared), node)
        node.replace_all_uses_with(total, delete_user_cb=lambda user: user is not total)
        moved += 1
    if moved:
        gm.graph.lint()
        gm.recompile()
    return moved


def quantize_experts(gm: fx.GraphModule, options: Any, constant: Callable[..., fx.Node | None],
                     record: Callable[..., dict]) -> list[dict]:
    """Step 2 of the module docstring, in place; returns one layer record (``record(name,
    weight, q, search, key)``, quantize_int4's format) per quantized expert tensor; its
    constants are made with ``constant(gm, name, suffix, tensor)``."""
    records: list[dict] = []
    for node in _moe_nodes(gm):
        x, router_weight, gate_up, down, k, normalize = node.args[:6]
        if len(node.args) > 6 and any(a is not None for a in node.args[6:]):
            continue  # a shared expert split_shared_experts did not move: not this op's format
        tensors = [ir.get_constant(gate_up), ir.get_constant(down)]
        names = [param_name(gate_up), param_name(down)]
        if any(t is None or not t.is_floating_point() for t in tensors):
            continue  # expert weights not frozen floating constants (freeze_weights=False?)
        if any(fnmatch.fnmatchcase(n, p) for n in names for p in options.skip):
            continue
        if any(t.numel() < options.min_size for t in tensors):
            continue
        dtype = val(x).dtype if options.scale_dtype == "auto" else options.scale_dtype
        search = "mse" if options.search == "mse" else "rtn"
        args: list[Any] = []
        with gm.graph.inserting_before(node):
            for weight_node, weight, name in zip((gate_up, down), tensors, names):
                experts, rows, cols = weight.shape
                q = groupwise.quantize_int4(weight.reshape(experts * rows, cols), options.group_size,
                                               options.symmetric, dtype, search)
                parts = [q.packed.reshape(experts, rows, -1), q.scales.reshape(experts, rows, -1),
                         q.zeros.reshape(experts, rows, -1) if q.zeros is not None else None]
                args += [constant(gm, name, suffix, t) for suffix, t in zip(("qweight", "scales", "qzeros"), parts)]
                rec = record(name, weight.reshape(experts * rows, cols), q, search, weight_node.target)
                rec["shape"] = list(weight.shape)
                records.append(rec)
            fused = _call(gm, graphopt.int4_moe.default,
                          (x, router_weight, *args, options.group_size, k, normalize), node)
        node.replace_all_uses_with(fused)
        gm.graph.erase_node(node)
    if records:
        gm.graph.lint()
        gm.recompile()
    return records

