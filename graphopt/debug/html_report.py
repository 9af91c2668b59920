"""``graphopt debug --report out.html``: one self-contained page about a pipeline run.

The page holds the pipeline, per-pass statistics (the ``--timing`` table with the
numeric check), a before/after picture of the graph for each pass that changed it
(Graphviz when installed, the built-in layout otherwise; only the neighbourhood of the
change for big graphs), the unified diff of each change, the bisect result, the
reproducer, and the near misses. No scripts, fonts or stylesheets are fetched: the file
can be mailed or attached to a bug as it is.

It is built from the same dict ``graphopt debug --json`` prints, plus the graphs kept by
the KeepChanges instrument, so the page and the JSON never disagree.
"""

from __future__ import annotations

import datetime
from html import escape
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.fx as fx

from graphopt.debug import dot, svg_layout
from graphopt.debug.graph_view import GraphView, change_views

MAX_DIFF_LINES = 400
MAX_NEAR_MISSES = 200
RENDERERS = ("auto", "dot", "builtin")

Change = tuple[str, fx.GraphModule, fx.GraphModule]  # (pass, graph before, graph after)

_CSS = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; max-width: 1600px; }
h1 { font-size: 22px; } h2 { font-size: 18px; border-bottom: 1px solid #ccc; padding-bottom: 4px; margin-top: 32px; }
h3 { font-size: 15px; margin-top: 22px; }
table { border-collapse: collapse; margin: 8px 0; font-size: 13px; }
th, td { border: 1px solid #d0d0d0; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.ok { color: #2e7d32; } .bad { color: #c62828; font-weight: bold; } .muted { color: #777; }
.pair { display: flex; gap: 16px; flex-wrap: wrap; }
figure { margin: 0; flex: 1 1 600px; min-width: 300px; }
figcaption { font-size: 13px; color: #555; margin-bottom: 4px; }
.scroll { overflow: auto; max-height: 900px; border: 1px solid #e0e0e0; background: #fcfcfc; }
pre { background: #f7f7f7; padding: 8px; overflow: auto; font-size: 12px; }
.add { color: #1b5e20; background: #e8f5e9; } .del { color: #b71c1c; background: #ffebee; } .hunk { color: #6a1b9a; }
.legend span { display: inline-block; padding: 1px 8px; margin-right: 6px; border: 1px solid #888; border-radius: 4px; font-size: 12px; }
code { background: #f3f3f3; padding: 1px 4px; }
"""


def pick_renderer(renderer: str = "auto") -> str:
    if renderer not in RENDERERS:
        raise ValueError(f"renderer {renderer!r}: choose one of {', '.join(RENDERERS)}")
    if renderer == "auto":
        return "dot" if dot.dot_available() else "builtin"
    return renderer


def render_report(data: dict, changes: Sequence[Sequence[Change]], renderer: str = "auto") -> str:
    """The page as a string. ``data`` is the ``--json`` dict; ``changes[g]`` the kept
    (pass, before, after) graphs of graph ``g``."""
    page = _Page(pick_renderer(renderer))
    body = [f"<h1>graphopt debug: {escape(str(data.get('model', '')))}</h1>", _summary(data, page.renderer),
            _legend(), "<h2>Pipeline</h2>", _pipeline_table(data)]
    if "bisect" in data:
        body.append(_bisect(data["bisect"], data))
    if data.get("reproducer") is not None or data.get("reproducer_error"):
        body.append(_reproducer(data))
    for g in data.get("graphs", []):
        index = g["graph"]
        body.append(page.graph_section(g, changes[index] if index < len(changes) else []))
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>graphopt debug: {escape(str(data.get('model', '')))}</title><style>{_CSS}</style></head>"
            f"<body>\n{''.join(body)}\n</body></html>\n")


def write_report(path: str | Path, data: dict, changes: Sequence[Sequence[Change]], renderer: str = "auto") -> dict:
    """Write the page; returns ``{"path", "renderer", "bytes"}`` for the CLI and JSON."""
    html = render_report(data, changes, renderer)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(html, encoding="utf-8")
    return {"path": str(out), "renderer": pick_renderer(renderer), "bytes": len(html.encode())}


class _Page:
    """Per-page state: the renderer, and a counter that keeps SVG ids unique."""

    def __init__(self, renderer: str):
        self.renderer = renderer
        self.pictures = 0

    def picture(self, view: GraphView) -> str:
        self.pictures += 1
        if self.renderer == "dot":
            try:
                return dot.render_dot(view)
            except RuntimeError as error:
                fallback = svg_layout.render_svg(view, uid=f"p{self.pictures}")
                return f'<p class="muted">{escape(str(error))}; built-in layout instead</p>{fallback}'
        return svg_layout.render_svg(view, uid=f"p{self.pictures}")

    def graph_section(self, g: dict, changes: Sequence[Change]) -> str:
        index = g["graph"]
        parts = [f'<h2 id="graph-{index}">Graph {index}</h2>', _passes_table(g), _numerics_line(g)]
        if changes:
            parts.append("<h3>Changes</h3>")
        for pass_name, before, after in changes:
            parts.append(self.change_section(index, pass_name, before, after, g))
        parts.append(_near_misses(g))
        return "\n".join(parts)

    def change_section(self, index: int, pass_name: str, before: fx.GraphModule, after: fx.GraphModule,
                       g: dict) -> str:
        from graphopt.instrument import graph_diff

        record = next((p for p in g["passes"] if p["name"] == pass_name and p["status"] == "changed"), {})
        old_view, new_view = change_views(before, after, pass_name)
        note = f' <span class="muted">({escape(old_view.note)})</span>' if old_view.note else ""
        diff = graph_diff(before, after, pass_name).splitlines()
        shown = diff[:MAX_DIFF_LINES]
        more = f"\n... {len(diff) - len(shown)} more lines" if len(diff) > len(shown) else ""
        return (f'<section class="change" id="change-{index}-{escape(pass_name)}">'
                f"<h3>{escape(pass_name)}: {record.get('matches', 0)} matches, nodes "
                f"{record.get('nodes_before', '?')} → {record.get('nodes_after', '?')}</h3>{note}"
                f'<div class="pair"><figure><figcaption>before {escape(pass_name)}</figcaption>'
                f'<div class="scroll">{self.picture(old_view)}</div></figure>'
                f'<figure><figcaption>after {escape(pass_name)}</figcaption>'
                f'<div class="scroll">{self.picture(new_view)}</div></figure></div>'
                f"<details><summary>diff of the graph text ({len(diff)} lines)</summary>"
                f"<pre>{_diff_html(shown)}{escape(more)}</pre></details></section>")


def _summary(data: dict, renderer: str) -> str:
    rows = [("pipeline", f"<code>{escape(str(data.get('pipeline', '')))}</code>"),
            ("tolerance", escape(f"{data.get('tolerance', '')}")),
            ("graphs", str(len(data.get("graphs", [])))),
            ("generated", escape(datetime.datetime.now().isoformat(timespec="seconds"))),
            ("torch", escape(torch.__version__)),
            ("pictures", "Graphviz dot" if renderer == "dot" else "built-in layout (Graphviz dot not installed)")]
    return "<table class=\"summary\">" + "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows) + "</table>"


def _legend() -> str:
    items = [("new node (made by the pass)", "#d5f5d5"), ("removed node", "#fbdada"),
             ("rewired node", "#ffe3b3"), ("graphopt op", "#efe4fb"), ("input", "#e3ecfb"), ("constant", "#f1f1f1")]
    return '<p class="legend">' + "".join(f'<span style="background:{c}">{escape(t)}</span>' for t, c in items) + "</p>"


def _pipeline_table(data: dict) -> str:
    from graphopt.registry import all_passes

    known = all_passes()
    first = data["graphs"][0]["passes"] if data.get("graphs") else []
    status = {p["name"]: p["status"] for p in first}
    rows = []
    for i, name in enumerate(n for n in str(data.get("pipeline", "")).split(",") if n):
        summary = getattr(known.get(name), "summary", "")
        rows.append(f"<tr><td class=\"num\">{i + 1}</td><td><code>{escape(name)}</code></td>"
                    f"<td>{escape(summary)}</td><td>{escape(status.get(name, ''))}</td></tr>")
    return ('<table id="pipeline"><tr><th>#</th><th>pass</th><th>summary</th><th>status (graph 0)</th></tr>'
            + "".join(rows) + "</table>")


def _fmt(value: Any) -> str:
    """Numbers as the CLI tables print them (the library does not import the CLI)."""
    if isinstance(value, float):
        if value == 0:
            text = "0"
        elif value != value or abs(value) == float("inf") or abs(value) < 1e-3 or abs(value) >= 1e5:
            text = f"{value:.2e}"
        else:
            text = f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    else:
        text = "" if value is None else str(value)
    return escape(text)


def _passes_table(g: dict) -> str:
    head = ["pass", "status", "matches", "ms", "nodes before", "nodes after", "max abs err", "rel err", "numerics", "error"]
    rows = []
    for p in g["passes"]:
        num = p.get("numerics") or {}
        flag = "" if not num else ('<span class="ok">ok</span>' if num.get("ok") else '<span class="bad">FAIL</span>')
        cells = [f"<td><code>{escape(p['name'])}</code></td>", f"<td>{escape(p['status'])}</td>",
                 *(f'<td class="num">{_fmt(p[k])}</td>' for k in ("matches", "time_ms", "nodes_before", "nodes_after")),
                 f'<td class="num">{_fmt(num.get("max_abs_err"))}</td>', f'<td class="num">{_fmt(num.get("rel_err"))}</td>',
                 f"<td>{flag}</td>", f"<td>{escape(p.get('error') or '')}</td>"]
        rows.append("<tr>" + "".join(cells) + "</tr>")
    header = "".join(f"<th>{h}</th>" for h in head)
    return f'<table class="passes" id="passes-{g["graph"]}"><tr>{header}</tr>{"".join(rows)}</table>'


def _numerics_line(g: dict) -> str:
    checked = any(p.get("numerics") for p in g["passes"])
    if g.get("first_bad_pass"):
        return f'<p class="bad">numeric check: first pass past the tolerance: {escape(g["first_bad_pass"])}</p>'
    if checked:
        return '<p class="ok">numeric check: every pass within the tolerance</p>'
    return '<p class="muted">numeric check: no pass changed the graph, or the graph had no concrete inputs</p>'


def _bisect(found: dict | None, data: dict) -> str:
    if found is None:
        return f'<h2>Bisect</h2><p class="ok">{escape(data.get("bisect_summary", "output within the tolerance"))}</p>'
    rows = [("pass", found.get("pass")), ("rewrite index", found.get("rewrite_index")), ("node", found.get("node")),
            ("op", found.get("target")), ("rel err after", found.get("rel_err")),
            ("rel err before", found.get("rel_err_before")), ("graph", found.get("graph")),
            ("pipeline runs", found.get("runs")), ("note", found.get("note"))]
    table = "".join(f"<tr><th>{k}</th><td>{_fmt(v)}</td></tr>" for k, v in rows if v is not None)
    command = f"<p>reproduce: <code>{escape(found.get('command', ''))}</code></p>" if found.get("command") else ""
    diff = found.get("diff") or ""
    return (f'<h2>Bisect</h2><table id="bisect">{table}</table>{command}'
            f"<details open><summary>the rewrite</summary><pre>{_diff_html(diff.splitlines())}</pre></details>")


def _reproducer(data: dict) -> str:
    written = data.get("reproducer")
    if written is None:
        return f'<h2>Reproducer</h2><p class="bad">could not write it: {escape(data["reproducer_error"])}</p>'
    return (f"<h2>Reproducer</h2><p>pass <code>{escape(written['pass'])}</code> failed: "
            f"{escape(written.get('error') or '')}</p><p>rerun: <code>{escape(written['command'])}</code></p>")


def _near_misses(g: dict) -> str:
    misses = [m for m in g.get("near_misses") or [] if not m.get("screened")]  # screened: --why groups them
    if not misses:
        return ""
    rows = "".join(f"<tr><td><code>{escape(m['pass_name'])}</code></td><td>{escape(m['anchor'])}</td>"
                   f"<td>{escape(m['node'])}</td><td>{escape(m['reason'])}</td></tr>" for m in misses[:MAX_NEAR_MISSES])
    more = f'<p class="muted">{len(misses) - MAX_NEAR_MISSES} more not shown</p>' if len(misses) > MAX_NEAR_MISSES else ""
    return (f"<h3>Near misses ({len(misses)})</h3><table class=\"near-misses\"><tr><th>pass</th><th>candidate</th>"
            f"<th>stopped at</th><th>reason</th></tr>{rows}</table>{more}")


def _diff_html(lines: Sequence[str]) -> str:
    out = []
    for line in lines:
        cls = ("add" if line.startswith("+") and not line.startswith("+++") else
               "del" if line.startswith("-") and not line.startswith("---") else
               "hunk" if line.startswith("@@") else "")
        out.append(f'<span class="{cls}">{escape(line)}</span>' if cls else escape(line))
    return "\n".join(out)
