"""Find the first pass, then the first single rewrite, that breaks a graph's numerics.

LLVM's ``-opt-bisect-limit`` on FX graphs. Every rewrite a pass makes asks
``PassContext.allow_rewrite``, which numbers rewrites across the whole pipeline; with
``bisect_limit = K`` only rewrites 1..K happen. ``err(K)`` is the relative error
(graphopt.numerics.compare) of the pipeline's output graph at limit K against the
unoptimized input graph, both run on the same inputs. ``err(0)`` is the input graph
itself unless some pass changes numerics without asking permission.

The search runs in two steps, O(log N) pipeline runs in all:

1. Over passes: the rewrites of one pass are consecutive numbers, so the limit at the end
   of each pass's span is the pipeline "up to that pass". Bisect those to the first pass
   whose span end is past the tolerance.
2. Over that pass's rewrites: bisect its span to the K with err(K - 1) <= T < err(K).

Monotonicity. Bisecting assumes err(K) stays past the tolerance once it gets there. When
it does not (a later rewrite cancels an earlier error, or the error grows a little with
each of many rewrites that are harmless alone) the search still ends at a K where
err(K - 1) <= T < err(K), a rewrite that crosses the tolerance, but not necessarily the
first such K, and the rewrite may be only the last straw. The result carries both
errors and a note when err(K - 1) is already close to T, so the jump is visible; rerun
with ``--bisect-limit`` around K to look by hand.

Passes that change numerics without counting their rewrites. If err(0) is bad already,
the result names the pass (found by checking numerics after every pass at limit 0) with
no rewrite index: the counter cannot isolate its changes. If such a pass only acts on
nodes a counted rewrite made, the search ends at that rewrite; numerics are then checked
after every pass at limit K, and the result names the pass whose output goes bad, with
the rewrite that made its input (``rewrite_pass``) and a note.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch.fx as fx

from graphopt.config import Options
from graphopt.instrument import NumericCheck, graph_diff, run_graph
from graphopt.numerics import Diff, compare
from graphopt.pass_manager import Rewrite

# err(K - 1) above this share of the tolerance: the error built up over several rewrites.
_ACCUMULATED = 0.5
_DIFF_LINES = 60


@dataclass
class Probe:
    """One pipeline run at one bisect limit."""

    limit: int
    rel: float
    max_abs: float
    gm: fx.GraphModule
    rewrites: list[Rewrite]
    crash: str | None = None  # the optimized graph raised instead of returning


@dataclass
class BisectResult:
    """The rewrite that first takes the output past the tolerance (see the module doc)."""

    pass_name: str  # the pass after which the output first goes past the tolerance
    rewrite_index: int | None  # None: the pass changed numerics without counting rewrites
    node: str | None  # the node the rewrite started from (its anchor)
    target: str | None  # that node's op
    rel_err: float  # err(rewrite_index)
    rel_err_before: float  # err(rewrite_index - 1)
    max_abs_err: float
    diff: str  # the rewrite's change: graph at K - 1 against graph at K
    note: str | None = None
    rewrite_pass: str | None = None  # the pass that made rewrite K (differs from pass_name: see note)

    def to_dict(self) -> dict:
        return {"pass": self.pass_name, "rewrite_index": self.rewrite_index, "node": self.node,
                "target": self.target, "rewrite_pass": self.rewrite_pass, "rel_err": self.rel_err,
                "rel_err_before": self.rel_err_before, "max_abs_err": self.max_abs_err, "diff": self.diff,
                "note": self.note}


@dataclass
class Bisection:
    """Outcome for one graph: ``found`` is None when the full pipeline is within tolerance."""

    tolerance: float
    full_rel_err: float
    full_max_abs_err: float
    total_rewrites: int
    runs: int  # pipeline runs, the full one included
    seconds: float
    found: BisectResult | None = None
    probes: list[dict] = field(default_factory=list)  # [{limit, rel_err}] in the order run

    def to_dict(self) -> dict:
        return {**(self.found.to_dict() if self.found else {}), "tolerance": self.tolerance,
                "full_rel_err": self.full_rel_err, "full_max_abs_err": self.full_max_abs_err,
                "total_rewrites": self.total_rewrites, "runs": self.runs, "seconds": self.seconds,
                "probes": self.probes}


def bisect_rewrites(gm: fx.GraphModule, inputs: Sequence[Any], config: Options, tolerance: float) -> Bisection:
    """Bisect ``config``'s pipeline on ``gm`` to the first rewrite past ``tolerance``."""
    with _quiet_pass_failures():
        return _bisect(gm, inputs, config, tolerance)


@contextlib.contextmanager
def _quiet_pass_failures() -> Iterator[None]:
    """A pass that fails is skipped with a warning on every pipeline run; the caller's own
    run already showed it once, and a dozen probe runs would repeat it a dozen times."""
    logger = logging.getLogger("graphopt")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _bisect(gm: fx.GraphModule, inputs: Sequence[Any], config: Options, tolerance: float) -> Bisection:
    from graphopt.compiler import run_pipeline

    start = time.perf_counter()
    inputs = list(inputs)
    reference = run_graph(gm, inputs)
    probes: dict[int, Probe] = {}
    order: list[dict] = []

    def probe(limit: int) -> Probe:
        if limit not in probes:
            result, _ = run_pipeline(gm, config.replace(bisect_limit=limit, check_numerics=False), inputs)
            try:
                diff = compare(run_graph(result.gm, inputs), reference)
                crash = None
            except Exception as error:  # a broken rewrite may make the graph unrunnable
                diff, crash = Diff(float("inf"), float("inf")), f"{type(error).__name__}: {error}"
            probes[limit] = Probe(limit, diff.rel, diff.max_abs, result.gm, list(result.rewrites), crash)
            order.append({"limit": limit, "rel_err": diff.rel, **({"crash": crash} if crash else {})})
        return probes[limit]

    def bad(limit: int) -> bool:
        return not probe(limit).rel <= tolerance  # NaN counts as bad

    full = probe(-1)
    probes[len(full.rewrites)] = full  # the limit that allows every rewrite is the full run
    outcome = Bisection(tolerance, full.rel, full.max_abs, len(full.rewrites), 0, 0.0, probes=order)
    if not bad(-1):
        return _finish(outcome, probes, start)
    if bad(0):
        outcome.found = _uncounted(gm, inputs, config, tolerance, probes[0])
        return _finish(outcome, probes, start, checks=1)
    spans = _spans(full.rewrites)
    lo, hi = -1, len(spans) - 1  # span hi ends past the tolerance; span lo (or limit 0) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if bad(spans[mid][2]) else (mid, hi)
    _, first, last = spans[hi]
    good_k, bad_k = first - 1, last
    while bad_k - good_k > 1:
        mid = (good_k + bad_k) // 2
        good_k, bad_k = (good_k, mid) if bad(mid) else (mid, bad_k)
    outcome.found = _culprit(gm, inputs, config, tolerance, bad_k, probes[good_k], probes[bad_k])
    return _finish(outcome, probes, start, checks=1)


def _spans(rewrites: list[Rewrite]) -> list[tuple[str, int, int]]:
    """``(pass, first index, last index)`` for each run of consecutive rewrites of one pass."""
    spans = []
    for name, group in itertools.groupby(rewrites, key=lambda r: r.pass_name):
        indices = [r.index for r in group]
        spans.append((name, indices[0], indices[-1]))
    return spans


def _culprit(gm: fx.GraphModule, inputs: list, config: Options, tolerance: float, k: int,
             good: Probe, bad: Probe) -> BisectResult:
    """Rewrite ``k`` crossed the tolerance. Check numerics after every pass at limit ``k``
    to confirm which pass's output goes bad: usually the rewrite's own pass, but a later
    pass that changes numerics without counting rewrites shows up here instead."""
    from graphopt.compiler import run_pipeline

    rewrite = next(r for r in bad.rewrites if r.index == k)
    checker = NumericCheck(inputs, tolerance)
    run_pipeline(gm, config.replace(bisect_limit=k, check_numerics=False), inputs, [checker])
    culprit = checker.first_bad or rewrite.pass_name
    note = None
    if culprit != rewrite.pass_name:
        note = (f"the output goes past the tolerance in {culprit}, which changes numerics without counting "
                f"its rewrites (PassContext.allow_rewrite); rewrite {k} of {rewrite.pass_name} made the node it changed")
    elif bad.crash:
        note = f"after this rewrite the graph no longer runs: {bad.crash}"
    elif good.rel > _ACCUMULATED * tolerance:
        note = (f"the error was already {good.rel:.3g} before this rewrite: it builds up over several "
                "rewrites and this one only crosses the tolerance")
    return BisectResult(culprit, rewrite.index, rewrite.node, rewrite.target, bad.rel, good.rel, bad.max_abs,
                        _short_diff(good.gm, bad.gm, f"rewrite {rewrite.index}"), note, rewrite.pass_name)


def _uncounted(gm: fx.GraphModule, inputs: list, config: Options, tolerance: float, zero: Probe) -> BisectResult:
    """err(0) is bad: find the pass that changes numerics without asking allow_rewrite."""
    from graphopt.compiler import run_pipeline
    from graphopt.instrument import KeepChanges

    checker, changes = NumericCheck(inputs, tolerance), KeepChanges()
    run_pipeline(gm, config.replace(bisect_limit=0, check_numerics=False), inputs, [checker, changes])
    name = checker.first_bad or "(unknown)"
    diff = next((_short_diff(b, a, name) for p, b, a in changes.changes if p == name), "")
    return BisectResult(name, None, None, None, zero.rel, 0.0, zero.max_abs, diff,
                        note=f"{name} changes numerics without counting its rewrites "
                             "(PassContext.allow_rewrite), so no single rewrite can be isolated")


def _short_diff(before: fx.GraphModule, after: fx.GraphModule, label: str) -> str:
    lines = graph_diff(before, after, label).splitlines()
    if len(lines) > _DIFF_LINES:
        lines = lines[:_DIFF_LINES] + [f"... {len(lines) - _DIFF_LINES} more lines"]
    return "\n".join(lines)


def _finish(outcome: Bisection, probes: dict, start: float, checks: int = 0) -> Bisection:
    outcome.runs = len({id(p) for p in probes.values()}) + checks
    outcome.seconds = time.perf_counter() - start
    return outcome
