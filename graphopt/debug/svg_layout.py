"""A built-in layered SVG drawing of a GraphView, for machines without Graphviz.

Layout (a plain Sugiyama-style sketch, enough for the few dozen nodes a view holds):
layers are networkx topological generations, so every edge points down; inputs and
constants move down to just above their first user instead of all crowding the top row;
within a layer, nodes are ordered by the mean position of their producers (one
barycentre sweep), which removes most crossings on the chain-like graphs passes make.
Edges are cubic curves with an arrowhead; everything is inline (no fonts, no scripts).
"""

from __future__ import annotations

from html import escape

import networkx as nx

from graphopt.debug.graph_view import GraphView, ViewNode

CHAR_W = 7.2  # width of one character of 12px monospace, near enough
NODE_H = 38
GAP_X = 18
GAP_Y = 46
PAD = 14

FILL = {"input": "#e3ecfb", "const": "#f1f1f1", "op": "#ffffff", "fused": "#efe4fb", "output": "#fff4cc"}
STATE_STYLE = {  # (fill, stroke, dash) overriding the kind's fill
    "new": ("#d5f5d5", "#2e7d32", ""),
    "removed": ("#fbdada", "#c62828", "5,3"),
    "rewired": (None, "#ef8f00", ""),
}


def layers_of(view: GraphView) -> list[list[str]]:
    """Node names by layer, top to bottom, each layer ordered left to right."""
    g = nx.DiGraph()
    g.add_nodes_from(n.name for n in view.nodes)
    g.add_edges_from(view.edges)
    layer = {}
    for depth, generation in enumerate(nx.topological_generations(g)):
        for name in generation:
            layer[name] = depth
    for name in g.nodes:
        users = list(g.successors(name))
        if g.in_degree(name) == 0 and users:  # sources sit just above their first user
            layer[name] = max(0, min(layer[u] for u in users) - 1)
    order = {n.name: i for i, n in enumerate(view.nodes)}
    rows: list[list[str]] = [[] for _ in range(max(layer.values(), default=-1) + 1)]
    for name in sorted(layer, key=order.__getitem__):
        rows[layer[name]].append(name)
    position: dict[str, float] = {}  # centre of a placed node, as a share of its row's width
    for row in rows:
        def barycentre(name: str) -> float:
            preds = [position[p] for p in g.predecessors(name) if p in position]
            return sum(preds) / len(preds) if preds else order[name] / max(len(order), 1)
        row.sort(key=lambda name: (barycentre(name), order[name]))
        for i, name in enumerate(row):
            position[name] = (i + 0.5) / len(row)
    return [row for row in rows if row]


def node_width(node: ViewNode) -> float:
    return max(len(node.title), len(node.detail), 4) * CHAR_W + 16


def render_svg(view: GraphView, uid: str = "g") -> str:
    """The view as one ``<svg>`` element (no XML prolog, ready to inline in HTML).

    ``uid`` keeps the arrowhead's id unique in a page of many pictures: a marker
    defined inside a collapsed (display: none) picture would not draw elsewhere."""
    by_name = {n.name: n for n in view.nodes}
    rows = layers_of(view)
    widths = [sum(node_width(by_name[n]) for n in row) + GAP_X * (len(row) - 1) for row in rows]
    total_w = max(widths, default=100) + 2 * PAD
    total_h = len(rows) * NODE_H + max(len(rows) - 1, 0) * GAP_Y + 2 * PAD
    box: dict[str, tuple[float, float, float]] = {}  # name -> (x, y, width)
    for r, (row, row_w) in enumerate(zip(rows, widths)):
        x = (total_w - row_w) / 2
        y = PAD + r * (NODE_H + GAP_Y)
        for name in row:
            w = node_width(by_name[name])
            box[name] = (x, y, w)
            x += w + GAP_X
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="graph" width="{total_w:.0f}" height="{total_h:.0f}" '
        f'viewBox="0 0 {total_w:.0f} {total_h:.0f}" font-family="monospace" font-size="12">',
        f'<defs><marker id="arrow-{uid}" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker></defs>',
    ]
    for src, dst in view.edges:
        x1, y1, w1 = box[src]
        x2, y2, w2 = box[dst]
        sx, sy, tx, ty = x1 + w1 / 2, y1 + NODE_H, x2 + w2 / 2, y2
        bend = max((ty - sy) / 2, 12)
        parts.append(f'<path d="M{sx:.1f},{sy:.1f} C{sx:.1f},{sy + bend:.1f} {tx:.1f},{ty - bend:.1f} {tx:.1f},{ty:.1f}" '
                     f'fill="none" stroke="#777" stroke-width="1.2" marker-end="url(#arrow-{uid})"/>')
    for name, (x, y, w) in box.items():
        parts.append(_node_svg(by_name[name], x, y, w))
    parts.append("</svg>")
    return "\n".join(parts)


def _node_svg(node: ViewNode, x: float, y: float, w: float) -> str:
    fill, stroke, dash = FILL.get(node.kind, "#fff"), "#444", ""
    if node.state in STATE_STYLE:
        state_fill, stroke, dash = STATE_STYLE[node.state]
        fill = state_fill or fill
    width = 2.4 if node.state != "kept" else 1.0
    dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
    cx = x + w / 2
    bold = ' font-weight="bold"' if node.kind == "fused" else ""
    text = [f'<text x="{cx:.1f}" y="{y + 15:.1f}" text-anchor="middle"{bold}>{escape(node.title)}</text>']
    if node.detail:
        text.append(f'<text x="{cx:.1f}" y="{y + 30:.1f}" text-anchor="middle" fill="#555" font-size="11">'
                    f'{escape(node.detail)}</text>')
    clipped = (f'<text x="{x + 3:.1f}" y="{y - 3:.1f}" fill="#999" font-size="11">⋯ more inputs</text>'
               if node.clipped else "")
    return (f'<g class="node {node.state}" data-name="{escape(node.name)}"><title>{escape(node.tooltip)}</title>'
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{NODE_H}" rx="6" fill="{fill}" '
            f'stroke="{stroke}" stroke-width="{width}"{dash_attr}/>{"".join(text)}{clipped}</g>')
