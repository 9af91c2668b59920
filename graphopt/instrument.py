"""PassManager instrumentation: printing IR, numeric checks, failure reproducers.

These are MLIR's pass-instrumentation switches on FX graphs. They run around passes
and never inside them; the debug CLI and the backend's options turn them on.
"""

from __future__ import annotations

import difflib
import sys
from typing import Any, Callable, Sequence, TextIO

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.numerics import compare
from graphopt.pass_manager import Instrument, Pass, PassContext, PassRecord


class PrintIR(Instrument):
    """Print the graph before / after chosen passes, as text or as a unified diff."""

    def __init__(self, before: Sequence[str] = (), after: Sequence[str] = (), after_all: bool = False,
                 after_change: bool = False, after_failure: bool = False, diff: bool = False,
                 stream: TextIO | None = None):
        self.before, self.after = set(before), set(after)
        self.after_all, self.after_change, self.after_failure = after_all, after_change, after_failure
        self.diff = diff
        self.stream = stream
        self.chunks: list[dict] = []  # what was printed, for --json

    def _emit(self, kind: str, pass_name: str, text: str) -> None:
        self.chunks.append({"when": kind, "pass": pass_name, "text": text})
        out = self.stream
        if out is not None:
            print(f"// ----- IR {kind} {pass_name} -----", file=out)
            print(text, file=out)

    def before_pass(self, p: Pass, gm: fx.GraphModule, ctx: PassContext) -> None:
        if p.name in self.before:
            self._emit("before", p.name, ir.format_graph(gm))

    def after_pass(self, p, before, after, record: PassRecord, ctx) -> None:
        changed = record.status == "changed"
        wanted = self.after_all or p.name in self.after or (self.after_change and changed)
        if not wanted:
            return
        if self.diff:
            self._emit("diff", p.name, graph_diff(before, after, p.name))
        else:
            self._emit("after", p.name, ir.format_graph(after))

    def after_failure(self, p, gm, error, record, ctx) -> None:
        if self.after_failure or self.after_all:
            self._emit("after failure of", p.name, f"// {record.error}\n" + ir.format_graph(gm))


def graph_diff(before: fx.GraphModule, after: fx.GraphModule, label: str = "") -> str:
    lines = difflib.unified_diff(
        ir.format_graph(before).splitlines(), ir.format_graph(after).splitlines(),
        fromfile=f"before {label}".strip(), tofile=f"after {label}".strip(), lineterm="")
    return "\n".join(lines)


def run_graph(gm: fx.GraphModule, inputs: Sequence[Any]) -> Any:
    with torch.no_grad():
        return gm(*inputs)


class NumericCheck(Instrument):
    """After each pass that changed the graph, run it on the same inputs and compare
    with the pipeline's input graph. Flags the first pass past ``tolerance``."""

    def __init__(self, inputs: Sequence[Any], tolerance: float,
                 runner: Callable[[fx.GraphModule, Sequence[Any]], Any] = run_graph):
        self.inputs = list(inputs)
        self.tolerance = tolerance
        self.runner = runner
        self.reference: Any = None
        self.first_bad: str | None = None

    def before_pass(self, p, gm, ctx) -> None:
        if self.reference is None:
            self.reference = self.runner(gm, self.inputs)

    def after_pass(self, p, before, after, record: PassRecord, ctx) -> None:
        if record.status != "changed":
            return
        diff = compare(self.runner(after, self.inputs), self.reference)
        record.numerics = {**diff.to_dict(), "ok": diff.rel <= self.tolerance}
        if diff.rel > self.tolerance and self.first_bad is None:
            self.first_bad = p.name
