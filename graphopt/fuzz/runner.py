"""The differential fuzzer: N generated models, each through graphopt on every target
available here, checked against eager; failures shrunk and written as reproducers. Each
model is compiled once and called at two shapes (a second batch or sequence length,
``graphopt.fuzz.shapes``), as a server calls it; a target that compiles again for the
second shape is counted (``recompiled``), one that gets it wrong is a failure.

``run_fuzz(graphs, seed)`` is what ``graphopt fuzz`` calls. Graph ``i`` of seed ``S`` is
drawn from ``random.Random(f"{S}/{i}")``, so any one graph can be regenerated alone.
Targets are looked up at run time: one that cannot run here (its module missing, its
package or hardware absent) is skipped and the summary says why.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from graphopt.config import Options
from graphopt.errors import GraphoptError, OptionsError
from graphopt.fuzz.case import Case, RandomDraw
from graphopt.fuzz.check import ROUTING_TIE, Outcome, check_module, reference
from graphopt.fuzz.generate import Settings, expectations, generate, kinds
from graphopt.fuzz.source import materialize
from graphopt.targets import NAMES, fuzzed_targets, get_target

ALL_TARGETS = fuzzed_targets()  # graphopt.targets' table: every target but tensorrt
# Fusion passes that are registered but not (yet) in the default pipeline; the fuzzer runs
# them too, in this order (fuse_attention looks through the copies fuse_rope leaves).
EXTRA_FUSIONS = ("fuse_rope", "fuse_attention")


def fuzz_pipeline() -> list[str]:
    """The default pipeline plus every registered fusion pass it leaves out."""
    from graphopt.pipeline import DEFAULT_PIPELINE, build_pipeline
    from graphopt.registry import all_passes

    names = list(DEFAULT_PIPELINE) + [p for p in EXTRA_FUSIONS if p in all_passes() and p not in DEFAULT_PIPELINE]
    build_pipeline(names)  # checks every pass's preconditions now, not once per graph
    return names


def resolve_targets(requested: Sequence[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """(targets that can run here, {target: why not} for the others).

    Without a GPU the triton target runs only under TRITON_INTERPRET=1, which must be set
    when the process starts (``triton.jit`` reads it as kernels are defined, some at import
    time); its reason for being unavailable says so."""
    names = list(requested or ALL_TARGETS)
    for name in names:
        Options.parse({"target": name})  # an unknown name fails with the list of valid ones
        if name == "auto":
            raise OptionsError(f"graphopt fuzz needs a named target ({', '.join(NAMES)}), not auto")
    usable, skipped = [], {}
    for name in names:
        try:
            target = get_target(name)
            reason = target.unavailable_reason(Options.parse({"target": name}))
        except GraphoptError as error:
            reason = str(error)
        if reason:
            skipped[name] = reason
        else:
            usable.append(name)
    return usable, skipped


@dataclass
class Failure:
    """A mismatch or crash, shrunk; ``reproducer`` is its folder when one was written."""

    graph: int
    target: str
    status: str
    detail: str
    case: str  # one-line description of the shrunk case
    steps_before: int
    steps_after: int
    reproducer: str | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class TargetStats:
    graphs: int = 0
    mismatches: int = 0
    crashes: int = 0
    routing_ties: int = 0  # graphs that routed a tied token the other way (not mismatches)
    fell_back: int = 0  # graphs where at least one pass or the target fell back
    recompiled: int = 0  # graphs compiled again at a second shape of sizes >= 2 (one compile should serve it)
    worst_rel_err: float = 0.0  # largest error judged ok (past tolerance only when eager is as far off)
    worst_graph: str = ""


@dataclass
class Summary:
    seed: int
    pipeline: list[str]
    graphs: int = 0
    invalid: int = 0
    targets: dict[str, TargetStats] = field(default_factory=dict)
    skipped_targets: dict[str, str] = field(default_factory=dict)
    fallbacks: Counter = field(default_factory=Counter)  # (target, where, reason) -> graphs
    fallback_dtypes: dict = field(default_factory=dict)  # (target, where, reason) -> dtypes of those graphs
    hits: Counter = field(default_factory=Counter)  # pass -> matches (first target of each graph)
    near_misses: Counter = field(default_factory=Counter)  # pass -> near misses
    planted: Counter = field(default_factory=Counter)  # pass -> matches the planted patterns call for
    failures: list[Failure] = field(default_factory=list)
    routing_ties: list[dict] = field(default_factory=list)  # {graph, target, detail} of each routing tie
    invalid_examples: list[str] = field(default_factory=list)
    multi_shape: int = 0  # cases called at two shapes through one compile
    single_shape_examples: list[str] = field(default_factory=list)  # why a case had no second shape
    seconds: float = 0.0

    @property
    def mismatches(self) -> int:
        return sum(t.mismatches for t in self.targets.values())

    @property
    def crashes(self) -> int:
        return sum(t.crashes for t in self.targets.values())

    def to_dict(self) -> dict:
        return {
            "graphs": self.graphs,
            "mismatches": self.mismatches,
            "crashes": self.crashes,
            "fallbacks": [{"target": t, "where": w, "reason": r, "graphs": n,
                           "dtypes": sorted(self.fallback_dtypes.get((t, w, r), ()))}
                          for (t, w, r), n in self.fallbacks.most_common()],
            "hits": dict(sorted(self.hits.items())),
            "no_hits": [p for p in self.pipeline if p.startswith(("fuse_", "merge_")) and not self.hits.get(p)],
            "planted": dict(sorted(self.planted.items())),
            "near_misses": dict(sorted(self.near_misses.items())),
            "invalid": self.invalid,
            "invalid_examples": self.invalid_examples,
            "multi_shape": self.multi_shape,
            "single_shape": self.graphs - self.invalid - self.multi_shape,
            "single_shape_examples": self.single_shape_examples,
            "seed": self.seed,
            "pipeline": self.pipeline,
            "targets": {name: dict(stats.__dict__) for name, stats in self.targets.items()},
            "skipped_targets": self.skipped_targets,
            "failures": [f.to_dict() for f in self.failures],
            "routing_ties": self.routing_ties,
            "seconds": round(self.seconds, 1),
        }


def case_for(seed: int, index: int, settings: Settings = Settings()) -> Case:
    return generate(RandomDraw(f"{seed}/{index}"), settings, name=f"seed{seed}_graph{index}")


def check_case(case: Case, targets: Sequence[str], pipeline: Sequence[str] | None) -> list[Outcome]:
    """``case`` on each target: one compile, called at the case's shape and at a second
    batch or sequence length when the case allows one (``graphopt.fuzz.shapes``)."""
    from graphopt.fuzz.shapes import second_shape

    module, inputs, _ = materialize(case)
    ref = reference(module, inputs)
    if ref.problem:
        return [Outcome(t, "invalid", ref.problem) for t in targets]
    shape, why = second_shape(case, module)
    more = [(shape.describe(), shape.inputs, shape.ref)] if shape else []
    outcomes = []
    for t in targets:
        outcome = check_module(module, inputs, t, pipeline, case.dtypes(), ref, more)
        outcome.single_shape_reason = why
        outcome.grew_from_one = shape is not None and shape.old < 2  # dynamo specializes a size of 1
        outcomes.append(outcome)
    return outcomes


def _checker(target: str, pipeline: Sequence[str] | None) -> Callable[[Case], Outcome]:
    """``check_case`` on one target, as ``shrink`` calls it for each candidate."""
    return lambda candidate: check_case(candidate, [target], pipeline)[0]


def run_fuzz(graphs: int, seed: int, targets: Sequence[str] | None = None, out_dir: str | Path | None = None,
             settings: Settings = Settings(), pipeline: Sequence[str] | None = None, shrink_budget: int = 40,
             on_graph: Callable[[int, Summary], None] | None = None) -> Summary:
    """Fuzz ``graphs`` generated models; ``on_graph(i, summary)`` after each (progress)."""
    from graphopt.fuzz.reproducer import write_reproducer
    from graphopt.fuzz.shrink import shrink

    unknown = sorted(set(settings.only) - set(kinds()))
    if unknown:
        raise OptionsError(f"unknown step kind(s) {', '.join(unknown)}; valid: {', '.join(kinds())}")
    usable, skipped = resolve_targets(targets)
    if not usable:
        raise GraphoptError("no target can run here: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    pipeline = list(pipeline) if pipeline is not None else fuzz_pipeline()
    summary = Summary(seed, pipeline, skipped_targets=skipped, targets={t: TargetStats() for t in usable})
    start = time.perf_counter()
    for index in range(graphs):
        case = case_for(seed, index, settings)
        outcomes = check_case(case, usable, pipeline)
        _tally(summary, case, outcomes)
        for outcome in outcomes:
            if outcome.failed:
                small, small_outcome, _ = shrink(case, outcome, _checker(outcome.target, pipeline), shrink_budget)
                folder = write_reproducer(small, outcome.target, pipeline, out_dir, small_outcome) if out_dir else None
                summary.failures.append(Failure(index, outcome.target, outcome.status, small_outcome.detail,
                                                small.describe(), len(case.steps), len(small.steps),
                                                str(folder) if folder else None))
        summary.seconds = time.perf_counter() - start
        if on_graph:
            on_graph(index, summary)
    return summary


def _general(reason: str) -> str:
    """A fallback reason without the node names that make each graph's unique, so they group."""
    reason = re.sub(r"node with name '[^']*'", "node", reason.splitlines()[0] if reason else reason)
    return re.sub(r"\b([A-Za-z][A-Za-z0-9]*(?:_[A-Za-z][A-Za-z0-9]*)*)_\d+\b", r"\1_N", reason)[:300]


def _tally(summary: Summary, case: Case, outcomes: list[Outcome]) -> None:
    summary.graphs += 1
    if outcomes and all(o.status == "invalid" for o in outcomes):
        summary.invalid += 1
        if len(summary.invalid_examples) < 5:
            summary.invalid_examples.append(f"{case.name}: {outcomes[0].detail}")
        return
    for e in expectations(case):
        summary.planted[e.pass_name] += e.fires
    if outcomes and outcomes[0].shapes > 1:
        summary.multi_shape += 1
    elif outcomes and len(summary.single_shape_examples) < 5:
        summary.single_shape_examples.append(f"{case.name}: {outcomes[0].single_shape_reason}")
    first = True
    for outcome in outcomes:
        stats = summary.targets[outcome.target]
        stats.graphs += 1
        stats.mismatches += outcome.status == "mismatch"
        stats.crashes += outcome.status == "crash"
        if outcome.status == ROUTING_TIE:
            stats.routing_ties += 1
            summary.routing_ties.append({"graph": case.name, "target": outcome.target, "detail": outcome.detail})
        stats.fell_back += bool(outcome.fallbacks)
        stats.recompiled += bool(outcome.recompiles) and not outcome.grew_from_one
        if outcome.status == "ok" and outcome.rel_err > stats.worst_rel_err:
            stats.worst_rel_err, stats.worst_graph = outcome.rel_err, case.name
        for f in {(f["target"], f["where"], _general(f["reason"])) for f in outcome.fallbacks}:
            summary.fallbacks[f] += 1
            summary.fallback_dtypes.setdefault(f, set()).add(case.dtype)
        if first:  # passes do the same on every target; count them once per graph
            summary.hits.update(outcome.hits)
            summary.near_misses.update(m.pass_name for m in outcome.near_misses)
            first = False
