"""Compile reports: one per compiled graph, kept until ``graphopt.reset()``.

``CompileReport.to_dict()`` is a stable interface (the CLI's ``--json`` prints it):
``backend``, ``target``, ``passes`` (``name, matches, time_ms, nodes_before,
nodes_after`` and more, in the order run: the FX pipeline's, then those a target ran on its own
form of the graph, e.g. ``onnx:tidy_attention_layout`` on an exported ONNX model, once per build), ``op_counts`` (graphopt ops named
``graphopt.<op>``), ``fallbacks`` (``where, reason``), ``off_target_ops`` (``op, count,
reason, how``: each op the target decomposed or left to eager instead of running it), ``builds`` (``what, shapes,
dynamic_dims, seconds``: every export, session or kernel a target built for this graph,
also those built later, at run time), ``recompile_reason`` (the dynamo guard whose failure
made this graph, or None), ``routing`` (None unless ``record_routing`` is on: per MoE layer
``layer, experts, k, calls, tokens, tokens_per_expert, imbalance, topk_changes,
rows_compared, topk_change_rate``; see graphopt.routing).

A target records a build with :func:`record_build` while it compiles (the compiler makes the
graph's report current around ``target.compile``), or on the report it took from
:func:`current_report` when it builds lazily, at run time.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from dataclasses import dataclass, field
from typing import Any

from graphopt.pass_manager import NearMiss, PassRecord, Rewrite


@dataclass
class CompileReport:
    target: str
    requested_target: str
    frontend: str
    backend: str = "graphopt"
    passes: list[PassRecord] = field(default_factory=list)
    op_counts: dict[str, int] = field(default_factory=dict)
    fallbacks: list[dict] = field(default_factory=list)
    near_misses: list[NearMiss] = field(default_factory=list)
    rewrites: list[Rewrite] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # Each op the target did not run as itself: {"op", "count", "reason", "how": "decomposed" | "eager"}.
    off_target_ops: list[dict] = field(default_factory=list)
    frozen_weights: int = 0
    nodes_in: int = 0
    nodes_out: int = 0
    compile_s: float = 0.0
    graph_index: int = -1
    builds: list[dict] = field(default_factory=list)
    recompile_reason: str | None = None
    routing: Any = None  # graphopt.ops.moe.RoutingLog, filled while the graph runs (record_routing)

    def add_fallback(self, where: str, reason: str) -> None:
        self.fallbacks.append({"where": where, "reason": reason})

    def record_build(self, what: str, shapes: list, dynamic_dims: list[str], seconds: float, **detail: Any) -> None:
        """One build: ``what`` ("onnxruntime session"), the input ``shapes`` it serves (a
        symbolic size as its name, ``[1, "s0"]``), which ``dynamic_dims`` it keeps open, and
        how long it took; ``detail`` adds keys (a breakdown of the seconds)."""
        with _lock:  # a lazy build may run on another thread than the reader
            self.builds.append({"what": what, "shapes": shapes, "dynamic_dims": list(dynamic_dims),
                                "seconds": round(seconds, 4), **detail})

    def record_target_passes(self, records: list[PassRecord], near_misses: list[NearMiss]) -> None:
        """Passes a target ran on its own form of the graph (an ONNX model), reported as FX passes are."""
        with _lock:  # a lazy build may run on another thread than the reader
            self.passes.extend(records)
            self.near_misses.extend(near_misses)

    def fused_op_counts(self) -> dict[str, int]:
        return {k: v for k, v in self.op_counts.items() if k.startswith("graphopt.")}

    def to_dict(self) -> dict[str, Any]:
        from graphopt.quant.report import int4_summary

        passes = [r.to_dict() for r in self.passes]
        return {
            "backend": self.backend,
            "target": self.target,
            "requested_target": self.requested_target,
            "frontend": self.frontend,
            "graph_index": self.graph_index,
            "passes": passes,
            "op_counts": dict(self.op_counts),
            "fallbacks": list(self.fallbacks),
            "near_misses": [m.to_dict() for m in self.near_misses],
            "rewrites": len(self.rewrites),
            "notes": list(self.notes),
            "off_target_ops": [dict(op) for op in self.off_target_ops],
            "frozen_weights": self.frozen_weights,
            "nodes_in": self.nodes_in,
            "nodes_out": self.nodes_out,
            "compile_s": self.compile_s,
            "builds": [dict(b) for b in self.builds],
            "recompile_reason": self.recompile_reason,
            "routing": self.routing.summary() if self.routing is not None else None,
            "int4": int4_summary({"passes": passes}),  # None unless quantize_int4 ran
        }


def routing_table(layers: list[dict]) -> str:
    """``to_dict()["routing"]`` as a small text table: one row per MoE layer."""
    rows = [["layer", "calls", "tokens", "tokens per expert", "max/mean", "top-k jitter"]]
    for r in layers:
        jitter = (f"{r['topk_change_rate']:.3f} ({r['topk_changes']}/{r['rows_compared']})"
                  if r["topk_change_rate"] is not None else "- (no steps)")
        imbalance = f"{r['imbalance']:.2f}" if r["imbalance"] is not None else "-"
        rows.append([r["layer"], str(r["calls"]), str(r["tokens"]), " ".join(map(str, r["tokens_per_expert"])),
                     imbalance, jitter])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) if i in (0, 3) else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(row, widths))).rstrip() for row in rows)


_lock = threading.Lock()
_reports: list[CompileReport] = []
_current: contextvars.ContextVar[CompileReport | None] = contextvars.ContextVar("graphopt_report", default=None)


@contextlib.contextmanager
def building_for(report: CompileReport):
    """Make ``report`` the one :func:`record_build` and :func:`current_report` see."""
    token = _current.set(report)
    try:
        yield report
    finally:
        _current.reset(token)


def current_report() -> CompileReport | None:
    """The report of the graph being compiled (None outside a compile, e.g. ``graphopt export``)."""
    return _current.get()


def record_build(what: str, shapes: list, dynamic_dims: list[str], seconds: float, **detail: Any) -> None:
    """Record a build on the current report; a build outside any compile is not reported."""
    report = _current.get()
    if report is not None:
        report.record_build(what, shapes, dynamic_dims, seconds, **detail)


def record(report: CompileReport) -> CompileReport:
    with _lock:
        report.graph_index = len(_reports)
        _reports.append(report)
    return report


def reports() -> list[CompileReport]:
    """One report per graph compiled since the last :func:`reset`, oldest first."""
    with _lock:
        return list(_reports)


def reset() -> None:
    """Forget the reports (compiled graphs stay compiled; see ``torch._dynamo.reset``)."""
    with _lock:
        _reports.clear()
