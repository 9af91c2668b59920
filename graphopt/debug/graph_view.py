"""What a picture of one pass's change shows: the nodes around what changed.

A 200-node graph drawn whole is unreadable, and a pass usually touches a few spots. So a
picture holds whole changed spots (connected groups of nodes the pass created, removed or
rewired) with their neighbours, in graph order, as many as fit in ``max_nodes``; the same
node names are chosen for the before and the after picture so the two line up. Small graphs are drawn whole. The renderers
(svg_layout, dot) only draw what a ``GraphView`` lists.
"""

from __future__ import annotations

import operator
from collections import deque
from dataclasses import dataclass

import networkx as nx
import torch.fx as fx

from graphopt import ir

MAX_NODES = 40
HOPS = 1


@dataclass
class ViewNode:
    name: str
    title: str  # first line: the op, "input x", "const layers.0.w", "output"
    detail: str  # second line: dtype and shape
    kind: str  # input | const | op | fused | output
    state: str = "kept"  # kept | new | removed | rewired
    clipped: bool = False  # some of its inputs are not drawn
    tooltip: str = ""  # the node as one line of graph text


@dataclass
class GraphView:
    nodes: list[ViewNode]  # in graph (topological) order
    edges: list[tuple[str, str]]  # (producer, consumer) among drawn nodes
    total: int  # nodes in the whole graph
    note: str = ""  # what was left out, if anything


def change_views(before: fx.GraphModule, after: fx.GraphModule, pass_name: str,
                 max_nodes: int = MAX_NODES, hops: int = HOPS) -> tuple[GraphView, GraphView]:
    """Views of the graph before and after ``pass_name`` around what it changed."""
    old, new = _by_name(before), _by_name(after)
    created = [n for n in new if n not in old]
    removed = [n for n in old if n not in new]
    rewired = [n for n in new if n in old and _inputs(new[n]) != _inputs(old[n])]
    order = {name: i for i, name in enumerate([*old, *(n for n in new if n not in old)])}
    focus = sorted(dict.fromkeys(removed + rewired + created), key=order.__getitem__)
    if len(old) + len(created) <= max_nodes:
        names = set(old) | set(new)
        note = ""
    else:
        names, note = _neighbourhood(focus, old, new, max_nodes, hops)
    states = {**{n: "new" for n in created}, **{n: "removed" for n in removed}, **{n: "rewired" for n in rewired}}
    return _view(before, names, states, note), _view(after, names, states, note)


def whole_view(gm: fx.GraphModule, max_nodes: int = MAX_NODES) -> GraphView:
    """The first ``max_nodes`` nodes of a graph (for a graph no pass changed)."""
    names = {n.name for n in list(gm.graph.nodes)[:max_nodes]}
    total = len(gm.graph.nodes)
    return _view(gm, names, {}, f"first {max_nodes} of {total} nodes" if total > max_nodes else "")


def _by_name(gm: fx.GraphModule) -> dict[str, fx.Node]:
    return {n.name: n for n in gm.graph.nodes}


def _inputs(node: fx.Node) -> list[str]:
    return [a.name for a in node.all_input_nodes]


def _neighbourhood(focus: list[str], old: dict, new: dict, max_nodes: int, hops: int) -> tuple[set[str], str]:
    """Whole changed spots (connected groups of changed nodes) with their neighbours, in
    graph order, while they fit in ``max_nodes``: one readable spot beats five tangled."""
    spots = _spots(focus, old, new)
    chosen: dict[str, None] = {}
    shown = 0
    for spot in spots:
        around = _around(spot, old, new, hops)
        if chosen and len(chosen) + len([n for n in around if n not in chosen]) > max_nodes:
            break
        for name in around[:max_nodes - len(chosen)]:
            chosen[name] = None
        shown += 1
    note = f"{len(chosen)} of {max(len(old), len(new))} nodes around {shown} of {len(spots)} changed spots"
    return set(chosen), note


def _spots(focus: list[str], old: dict, new: dict) -> list[list[str]]:
    """Changed nodes grouped by adjacency in either graph, each group in graph order."""
    g = nx.Graph()
    g.add_nodes_from(focus)
    for graph in (old, new):
        for name in focus:
            node = graph.get(name)
            if node is not None:
                g.add_edges_from((name, other.name) for other in [*node.all_input_nodes, *node.users]
                                 if other.name in g)
    rank = {name: i for i, name in enumerate(focus)}
    spots = [sorted(c, key=rank.__getitem__) for c in nx.connected_components(g)]
    return sorted(spots, key=lambda spot: rank[spot[0]])


def _around(spot: list[str], old: dict, new: dict, hops: int) -> list[str]:
    """``spot`` then its neighbours up to ``hops`` edges away, breadth-first."""
    seen = dict.fromkeys(spot)
    queue = deque((name, 0) for name in spot)
    while queue:
        name, depth = queue.popleft()
        if depth >= hops:
            continue
        for graph in (old, new):
            node = graph.get(name)
            for other in ([*node.all_input_nodes, *node.users] if node is not None else []):
                if other.name not in seen:
                    seen[other.name] = None
                    queue.append((other.name, depth + 1))
    return list(seen)


def _view(gm: fx.GraphModule, names: set[str], states: dict[str, str], note: str) -> GraphView:
    nodes, edges = [], []
    for n in gm.graph.nodes:
        if n.name not in names:
            continue
        shown_inputs = [a for a in n.all_input_nodes if a.name in names]
        edges.extend((a.name, n.name) for a in shown_inputs)
        nodes.append(ViewNode(n.name, *_label(n), state=states.get(n.name, "kept"),
                              clipped=len(shown_inputs) < len(n.all_input_nodes), tooltip=ir.format_node(n)))
    return GraphView(nodes, edges, len(gm.graph.nodes), note)


def _label(n: fx.Node) -> tuple[str, str, str]:
    val = n.meta.get("val")
    detail = ir.describe_val(val) if val is not None else ""
    if n.op == "placeholder":
        return f"input {n.name}", detail, "input"
    if n.op == "get_attr":
        return "const " + _shorten(str(n.meta.get(ir.PARAM_NAME) or n.target)), detail, "const"
    if n.op == "output":
        return "output", "", "output"
    name = ir.target_name(n.target)
    if n.target is operator.getitem:
        name = f"getitem [{n.args[1]}]"
    return name, _shorten(detail, 40), "fused" if name.startswith("graphopt.") else "op"


def _shorten(text: str, limit: int = 32) -> str:
    """Keep the end of long names: ``...layers.0.mlp.up_proj.weight``."""
    return text if len(text) <= limit else "…" + text[-(limit - 1):]
