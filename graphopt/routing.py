"""Routing observability for compiled graphs: ``options={"record_routing": True}``.

For every ``graphopt.moe`` (or ``graphopt.int4_moe``) node the compiled graph gets one more output, the [tokens, k]
expert ids its router picks (``topk(softmax(float(x @ Wr^T)), k)``, the op's own routing),
computed by the target from plain ATen ops. The callable the target returns is wrapped:
it drops those outputs before the caller sees them and adds them to the graph report's
:class:`~graphopt.ops.moe.RoutingLog`, so ``report.to_dict()["routing"]`` holds, per MoE
layer, the tokens each expert got, the imbalance and the top-k set change rate between
consecutive calls with the same number of tokens (decode steps).

Why extra outputs and not a hook in the op: ONNX Runtime and Triton run the whole op in
their own kernels, where no Python sees the routing; a graph output works on every target.
With the option off (the default) the graph and the callable are left as they are: the
recording costs nothing.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.ops.moe import RoutingLog

aten = torch.ops.aten


def _k_index() -> dict:
    """Each MoE op and the position of its ``k`` argument (``x`` and the router weight lead)."""
    ops = {torch.ops.graphopt.moe.default: 4}
    try:
        ops[torch.ops.graphopt.int4_moe.default] = 9
    except (AttributeError, RuntimeError):  # graphopt's INT4 experts op not loaded: no graph holds it
        pass
    return ops


def moe_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    ops = _k_index()
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ops]


def add_routing_outputs(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[tuple[str, int]]]:
    """A copy of ``gm`` whose output is ``(original outputs..., ids of moe 0, ids of moe 1, ...)``,
    and each moe node's ``(name, experts)``. A graph without MoE comes back as it is, with []."""
    nodes = moe_nodes(gm)
    if not nodes:
        return gm, []
    gm = ir.copy_graph_module(gm)
    graph, fake_mode = gm.graph, ir.fake_mode_of(gm)
    ids, layers = [], []
    k_index = _k_index()
    for node in moe_nodes(gm):
        x, router_weight, k = node.args[0], node.args[1], node.args[k_index[node.target]]
        with graph.inserting_before(node):
            logits = graph.call_function(aten.mm.default, (x, graph.call_function(aten.t.default, (router_weight,))))
            probs = graph.call_function(aten._softmax.default, (
                graph.call_function(aten._to_copy.default, (logits,), {"dtype": torch.float32}), -1, False))
            topk = graph.call_function(aten.topk.default, (probs, k))
            chosen = graph.call_function(operator.getitem, (topk, 1))
        for new in (logits.args[1], logits, probs.args[0], probs, topk, chosen):
            new.meta[ir.CREATED_BY] = "record_routing"
            ir.infer_val(new, fake_mode)
        ids.append(chosen)
        layers.append((_layer_name(node, router_weight), int(router_weight.meta["val"].shape[0])))
    output = graph.output_node()
    original = output.args[0]
    flat = list(original) if isinstance(original, (tuple, list)) else [original]
    output.args = (tuple(flat + ids),)
    gm.meta["graphopt_routing_outputs"] = (len(flat), isinstance(original, (tuple, list)))
    gm.recompile()
    return gm, layers


def _layer_name(node: fx.Node, router_weight: fx.Node) -> str:
    """The router's parameter path without ``.weight`` (``model.layers.0.mlp.gate``), else the node's name."""
    if router_weight.op == "get_attr":
        return str(router_weight.target).removeprefix("w_").removesuffix(".weight").removesuffix("_weight")
    return node.name


def recording(compiled: Callable, gm: fx.GraphModule, layers: list[tuple[str, int]], log: RoutingLog) -> Callable:
    """Wrap the callable compiled from :func:`add_routing_outputs`'s graph: record the routing
    outputs in ``log`` and return the original outputs only."""
    n_out, was_sequence = gm.meta["graphopt_routing_outputs"]

    def run(*args: Any) -> Any:
        out = compiled(*args)
        for (name, experts), ids in zip(layers, out[n_out:]):
            log.add_layer(name, experts, ids, name)
        kept = out[:n_out]
        return kept if was_sequence else kept[0]

    return run


def lower_recording_routing(gm: fx.GraphModule, lower: Callable[[fx.GraphModule], Callable], report) -> Callable:
    """``lower(gm)`` with the routing of every ``graphopt.moe`` recorded on ``report.routing``."""
    instrumented, layers = add_routing_outputs(gm)
    if not layers:
        report.notes.append("record_routing: this graph has no graphopt.moe op; nothing to record")
        return lower(gm)
    report.routing = RoutingLog()
    return recording(lower(instrumented), instrumented, layers, report.routing)


def merged_summary(reports) -> list[dict]:
    """The routing of several graphs' reports (a prefill graph and a decode graph) as one
    summary per MoE layer, the layers named alike merged, calls in the reports' order."""
    merged = RoutingLog()
    for report in sorted(reports, key=lambda r: r.graph_index):
        log = report.routing
        if log is None:
            continue
        for key, calls in log.layers.items():
            for ids in calls:
                merged.add_layer(log.names[key], log.num_experts[key], ids, log.names[key])
    return merged.summary()
