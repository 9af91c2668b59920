"""Weight-load scheduling: each layer's weight fetch and unpack go right before the compute
that precedes the layer, so that a target that can overlap them loads layer i's weights
while layer i - 1 computes:
``[all weights] ... C1 ... C2 ... C3``  ->  ``W1 ... W2 C1 ... W3 C2 ... C3``.

Why: decoding streams every weight once per token. A target that fetches weights
asynchronously (a copy stream, weights streamed from host or remote memory, a DMA engine
feeding a CUDA graph) needs to know where to issue each fetch: at the top of the graph,
all weights are live at once; just before their own GEMM, nothing overlaps the fetch.
One compute ahead keeps one layer in flight. The eager and ONNX Runtime targets execute
the order as it is (a get_attr is an attribute read, ORT prepacks weights at load), so for
them this pass changes nothing but the printed order.

What it decides, on the dependency graph (networkx DiGraph of the FX nodes):
- compute nodes: GEMMs and attentions (``COMPUTE_OPS``), in program order;
- a compute node's weight loads: its constant ancestors (get_attr nodes and pure ops on
  constants only: a dtype cast, a transpose, an unpack), each given to the first compute
  node that reads it, when that compute reads it before any other node does;
- each load set is placed just before the compute ``lookahead`` computes earlier; a first
  layer has nothing to overlap and is loaded at the top of the graph;
- ``max_inflight_bytes`` (0 = no limit) caps the weight bytes fetched but not yet
  consumed at any point: a load that would exceed it moves one compute later, down to
  its own compute (when even that does not fit, the cap is exceeded and reported).
Nothing else moves: every other node keeps its relative order, and the new order is a
topological order of the same graph (checked).

Records: each load node's ``meta["graphopt_schedule"]`` says which compute it feeds and
which it overlaps (and ``meta["graphopt_note"]`` says it in the printed IR:
``graphopt debug MODEL --print-ir-after schedule_weight_loads``); the stats list every
decision under ``decisions`` (``graphopt debug --json``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
import torch.fx as fx

from graphopt import ir
from graphopt.pass_manager import PassContext, PassResult
from graphopt.rewrite import HEAVY_COMPUTE_OPS

aten = torch.ops.aten
SCHEDULE_META = "graphopt_schedule"

COMPUTE_OPS = frozenset({
    torch.ops.graphopt.int4_linear.default, torch.ops.graphopt.qkv_proj.default,
    torch.ops.graphopt.attention.default, *HEAVY_COMPUTE_OPS,
})


@dataclass
class ScheduleOptions:
    lookahead: int = field(default=1, metadata={
        "help": "issue a layer's weight loads this many compute nodes before its own"})
    max_inflight_bytes: int = field(default=0, metadata={
        "help": "cap on weight bytes fetched but not yet consumed; 0: no cap"})

    def __post_init__(self) -> None:
        if not isinstance(self.lookahead, int) or self.lookahead < 0:
            raise ValueError(f"lookahead must be an int >= 0, got {self.lookahead!r}")
        if not isinstance(self.max_inflight_bytes, int) or self.max_inflight_bytes < 0:
            raise ValueError(f"max_inflight_bytes must be an int >= 0, got {self.max_inflight_bytes!r}")


def dependency_graph(gm: fx.GraphModule) -> nx.DiGraph:
    """Data dependencies: an edge from every input node to each of its users."""
    graph = nx.DiGraph()
    for node in gm.graph.nodes:
        graph.add_node(node)
        for inp in node.all_input_nodes:
            graph.add_edge(inp, node)
    return graph


def constant_nodes(graph: nx.DiGraph) -> set[fx.Node]:
    """Nodes computed from constants alone: get_attr, and pure ops none of whose
    ancestors is a graph input (or has a side effect)."""
    sources = [n for n in graph if n.op in ("placeholder", "output") or (n.op == "call_function" and n.is_impure())]
    varying = set(sources)
    reached: set[fx.Node] = set()
    for source in sources:
        if source not in reached:  # a source downstream of another was covered by its walk
            reached |= nx.descendants(graph, source)
    varying |= reached
    return {n for n in graph if n not in varying and n.op in ("get_attr", "call_function")}


def _nbytes(node: fx.Node) -> int:
    tensor = ir.get_constant(node)
    if tensor is None:
        val = node.meta.get("val")
        tensor = val if isinstance(val, torch.Tensor) else None
    return tensor.numel() * tensor.element_size() if tensor is not None else 0


def plan_loads(gm: fx.GraphModule, graph: nx.DiGraph) -> list[tuple[fx.Node, list[fx.Node]]]:
    """(compute node, its weight loads in program order) for every compute node with loads.

    A constant belongs to the first compute that reads it. It can move only if nothing
    outside its compute's load set reads it before that compute (a norm weight read by
    the norm stays where it is), and neither can the constants feeding it.
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    constants = constant_nodes(graph)
    computes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in COMPUTE_OPS]
    owner: dict[fx.Node, fx.Node] = {}
    for compute in computes:
        for node in nx.ancestors(graph, compute) & constants:
            owner.setdefault(node, compute)
    plan = []
    for compute in computes:
        members = {n for n, c in owner.items() if c is compute}
        pinned = {n for n in members if any(u not in members and order[u] < order[compute] for u in n.users)}
        for n in list(pinned):
            pinned |= nx.ancestors(graph, n) & members
        loads = sorted(members - pinned, key=order.get)
        if loads:
            plan.append((compute, loads))
    return plan


class ScheduleWeightLoads:
    name = "schedule_weight_loads"
    summary = "place each layer's weight loads before the previous compute, so they can overlap it"
    Options = ScheduleOptions
    requires: tuple[str, ...] = ()

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        options = ctx.options_for(self)
        graph = dependency_graph(gm)
        nodes = list(gm.graph.nodes)
        order = {n: i for i, n in enumerate(nodes)}
        computes = [n for n in nodes if n.op == "call_function" and n.target in COMPUTE_OPS]
        rank = {c: i for i, c in enumerate(computes)}
        top = next(i for i, n in enumerate(nodes) if n.op != "placeholder") - 0.5
        # Sort key of every node: its program position, loads moved to a half position
        # (ties keep program order). Keys grow along every edge, so the topological sort
        # below is exactly this order, and nodes that are not loads keep theirs.
        key: dict[fx.Node, tuple[float, int]] = {n: (float(order[n]), order[n]) for n in nodes}
        decisions: list[dict[str, Any]] = []
        inflight: list[tuple[float, int, int]] = []  # (issued at, consumed at, bytes)
        for compute, loads in plan_loads(gm, graph):
            if not ctx.allow_rewrite(self.name, compute):
                continue
            size = sum(_nbytes(n) for n in loads if n.op == "get_attr")
            overlap, position = self._place(computes, rank[compute], order, top, size, inflight, options)
            inflight.append((position, order[compute], size))
            note = f"load for %{compute.name}" + (f", overlaps %{overlap.name}" if overlap is not None else "")
            for n in loads:
                key[n] = (position, order[n])
                n.meta[SCHEDULE_META] = {"role": "weight_load", "for": compute.name,
                                         "overlaps": overlap.name if overlap is not None else None}
                n.meta[ir.NOTE] = note
            compute.meta[SCHEDULE_META] = {"role": "compute", "loads": [n.name for n in loads]}
            decisions.append({
                "compute": compute.name, "op": ir.target_name(compute.target), "loads": [n.name for n in loads],
                "bytes": size, "overlaps": overlap.name if overlap is not None else None,
                "placed": "top of graph" if position == top else f"before {nodes[int(position + 0.5)].name}",
                "inflight_bytes": _inflight_at(position, inflight),
            })
        new_order = list(nx.lexicographical_topological_sort(graph, key=key.get))
        changed = new_order != nodes
        if changed:
            output = gm.graph.output_node()
            for node in new_order:
                if node is not output:
                    output.prepend(node)
            gm.graph.lint()
            gm.recompile()
        stats: dict[str, Any] = {
            "matches": len(decisions) if changed else 0,
            "loads_moved": sum(len(d["loads"]) for d in decisions) if changed else 0,
            "max_inflight_bytes": max((d["inflight_bytes"] for d in decisions), default=0),
            "decisions": decisions,
        }
        return PassResult(gm, modified=changed, stats=stats)

    @staticmethod
    def _place(computes, own: int, order: dict, top: float, size: int, inflight: list,
               options: ScheduleOptions) -> tuple[fx.Node | None, float]:
        """(the compute the loads overlap or None, the position they are issued at).

        ``lookahead`` computes back when the byte cap allows, else fewer, down to the
        compute's own position (no overlap). A first compute has nothing to overlap
        but the graph's prologue: its loads go to the top.
        """
        if own == 0 and options.lookahead > 0:
            return None, top
        for distance in range(min(options.lookahead, own), -1, -1):
            target = computes[own - distance]
            position = order[target] - 0.5
            fits = _inflight_at(position, inflight) + size <= options.max_inflight_bytes
            if distance == 0 or not options.max_inflight_bytes or fits:
                return (target if distance else None), position
        raise AssertionError("unreachable: distance 0 always places")


def _inflight_at(position: float, inflight: list) -> int:
    """Weight bytes issued at or before ``position`` whose compute comes after it."""
    return sum(size for at, consumed, size in inflight if at <= position < consumed)


schedule_weight_loads = ScheduleWeightLoads()
