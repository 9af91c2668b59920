"""Graphviz drawings of a GraphView, when the ``dot`` program is installed.

``dot`` lays out graphs better than the built-in layout (it routes edges around nodes),
so the report uses it when ``shutil.which("dot")`` finds it and falls back to
svg_layout when it is missing or fails. Colours match the built-in drawing.
"""

from __future__ import annotations

import re
import shutil
import subprocess

from graphopt.debug.graph_view import GraphView, ViewNode
from graphopt.debug.svg_layout import FILL, STATE_STYLE

TIMEOUT_S = 30


def dot_available() -> bool:
    return shutil.which("dot") is not None


def to_dot(view: GraphView) -> str:
    lines = ["digraph G {", '  rankdir=TB; bgcolor="transparent";',
             '  node [shape=box, style="rounded,filled", fontname="monospace", fontsize=10];',
             '  edge [color="#777777", arrowsize=0.7];']
    for node in view.nodes:
        lines.append(f"  {_quote(node.name)} [{_attributes(node)}];")
    for src, dst in view.edges:
        lines.append(f"  {_quote(src)} -> {_quote(dst)};")
    lines.append("}")
    return "\n".join(lines)


def _attributes(node: ViewNode) -> str:
    fill, color, style = FILL.get(node.kind, "#ffffff"), "#444444", "rounded,filled"
    if node.state in STATE_STYLE:
        state_fill, color, dash = STATE_STYLE[node.state]
        fill = state_fill or fill
        style += ",bold" + (",dashed" if dash else "")
    label = "\\n".join(_escape(line) for line in (node.title, node.detail) if line)  # a backslash-n is dot's line break
    attrs = {"fillcolor": fill, "color": color, "style": style, "tooltip": node.tooltip, "id": f"node-{node.name}"}
    return ", ".join([f'label="{label}"', *(f"{k}={_quote(v)}" for k, v in attrs.items())])


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _quote(text: str) -> str:
    return f'"{_escape(text)}"'


def render_dot(view: GraphView) -> str:
    """``dot -Tsvg`` of the view as an inline ``<svg>``; raises RuntimeError on failure."""
    try:
        proc = subprocess.run(["dot", "-Tsvg"], input=to_dot(view), capture_output=True, text=True,
                              timeout=TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise RuntimeError(f"dot failed: {error}") from error
    if proc.returncode != 0 or "<svg" not in proc.stdout:
        raise RuntimeError(f"dot failed: {proc.stderr.strip().splitlines()[:1]}")
    svg = proc.stdout[proc.stdout.index("<svg"):]
    return re.sub(r"<!--.*?-->", "", svg, flags=re.S)
