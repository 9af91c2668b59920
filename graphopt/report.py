"""Compile reports: one per compiled graph, kept until ``graphopt.reset()``.

``CompileReport.to_dict()`` is a stable interface (the CLI's ``--json`` prints it):
``backend``, ``target``, ``passes`` (``name, matches, time_ms, nodes_before,
nodes_after`` and more, in the order run), ``op_counts`` (graphopt ops named
``graphopt.<op>``), ``fallbacks`` (``where, reason``).
"""

from __future__ import annotations

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
    frozen_weights: int = 0
    nodes_in: int = 0
    nodes_out: int = 0
    compile_s: float = 0.0
    graph_index: int = -1

    def add_fallback(self, where: str, reason: str) -> None:
        self.fallbacks.append({"where": where, "reason": reason})

    def fused_op_counts(self) -> dict[str, int]:
        return {k: v for k, v in self.op_counts.items() if k.startswith("graphopt.")}

    def to_dict(self) -> dict[str, Any]:
        from graphopt.quant_report import int4_summary

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
            "frozen_weights": self.frozen_weights,
            "nodes_in": self.nodes_in,
            "nodes_out": self.nodes_out,
            "compile_s": self.compile_s,
            "int4": int4_summary({"passes": passes}),  # None unless quantize_int4 ran
        }


_lock = threading.Lock()
_reports: list[CompileReport] = []


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
