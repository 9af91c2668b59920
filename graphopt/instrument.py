"""PassManager instrumentation: printing IR, numeric checks, kept changes.

These are MLIR's pass-instrumentation switches on FX graphs. They run around passes
and never inside them; the debug CLI and the backend's options turn them on.
"""

from __future__ import annotations

import difflib
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
        # on_failure, not after_failure: an attribute of that name would hide the hook below.
        self.after_all, self.after_change, self.on_failure = after_all, after_change, after_failure
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
        if self.on_failure or self.after_all:
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
    """After each pass that changed the graph, run it on the same inputs and compare it
    twice: with the previous pass's output (``max_abs_err`` / ``rel_err``: the error this
    pass introduced, which is what names a culprit) and with the pipeline's input graph
    (``max_abs_err_vs_input`` / ``rel_err_vs_input``: the error so far).

    ``first_bad``: the first pass whose own change is past ``tolerance``. ``first_drift``:
    the first pass after which the output is past it compared with the input; it differs
    from ``first_bad`` only when small errors of several passes add up (or one cancels)."""

    def __init__(self, inputs: Sequence[Any], tolerance: float,
                 runner: Callable[[fx.GraphModule, Sequence[Any]], Any] = run_graph):
        self.inputs = list(inputs)
        self.tolerance = tolerance
        self.runner = runner
        self.reference: Any = None  # the input graph's outputs
        self.previous: Any = None  # the outputs of the last graph that changed
        self.first_bad: str | None = None
        self.first_drift: str | None = None

    def before_pass(self, p, gm, ctx) -> None:
        if self.reference is None:
            self.reference = self.previous = self.runner(gm, self.inputs)

    def after_pass(self, p, before, after, record: PassRecord, ctx) -> None:
        if record.status != "changed":
            return
        outputs = self.runner(after, self.inputs)
        step, total = compare(outputs, self.previous), compare(outputs, self.reference)
        self.previous = outputs
        record.numerics = {**step.to_dict(), "max_abs_err_vs_input": total.max_abs,
                           "rel_err_vs_input": total.rel, "ok": step.rel <= self.tolerance}
        if step.rel > self.tolerance and self.first_bad is None:
            self.first_bad = p.name
        if total.rel > self.tolerance and self.first_drift is None:
            self.first_drift = p.name


class KeepChanges(Instrument):
    """Keep the graph before and after each pass that changed it, for pictures
    (``graphopt debug --report``). Costs references only: each pass already works on
    its own copy of the graph, and the copies share the weights."""

    def __init__(self) -> None:
        self.changes: list[tuple[str, fx.GraphModule, fx.GraphModule]] = []

    def after_pass(self, p, before, after, record: PassRecord, ctx) -> None:
        if record.status == "changed":
            self.changes.append((p.name, before, after))
