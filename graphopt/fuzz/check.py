"""Differential check of one module: eager PyTorch vs graphopt on one target.

Tolerances, by dtype, on the relative error ``||graphopt - eager|| / ||eager||`` of each
output (``graphopt.numerics.compare``):

    float32 1e-4, float16 1e-2, bfloat16 4e-2

An output gets the loosest tolerance among its own dtype and every dtype the model computes
in (a float32 model that rounds through float16 somewhere is only float16-accurate there).

A fused op may round differently from the chain of ops it replaced (graphopt's norms and
attention compute in float32 and round once), so an output past its tolerance is still
accepted when graphopt is no farther from a float64 run of the same module than
``ACCURACY_SLACK`` times eager's own distance from it: the case is ill-conditioned in that
dtype, and graphopt is as right as eager is. The float64 run routes every top-k as eager
did, and runs aten's grouped GEMM (which refuses float64) one group at a time.

A router whose top-k choice for a token is within rounding of the next expert may route that
token either way (``graphopt.fuzz.routing_ties``): an output that matches eager rerouted at
such a tie is a ``routing tie`` verdict, naming the token and experts, and not a mismatch.
A graph that raises is a crash; a target or pass that fell back is not a failure but is
reported with its reason.
"""

from __future__ import annotations

import copy
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
import torch.utils._pytree as pytree

import graphopt
from graphopt.fuzz.routing_ties import Router, Tie, least_precise_eps, near_ties, rerouted, reroutings
from graphopt.numerics import compare

TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 4e-2}
ACCURACY_SLACK = 2.0
ROUTING_TIE = "routing tie"


@dataclass
class Outcome:
    """What happened to one case on one target."""

    target: str
    status: str  # ok | routing tie | mismatch | crash | invalid (the eager model itself failed or overflowed)
    detail: str = ""
    rel_err: float = 0.0  # worst output's relative error against eager
    fallbacks: list[dict] = field(default_factory=list)
    hits: dict[str, int] = field(default_factory=dict)  # pass -> matches, summed over graphs
    near_misses: list = field(default_factory=list)  # graphopt.pass_manager.NearMiss
    ran_on: list[str] = field(default_factory=list)  # the target each compiled graph ran on
    shapes: int = 1  # how many input shapes the one compile was called at
    recompiles: int = 0  # graphs compiled again at a later shape (dynamo specialized a size)
    single_shape_reason: str = ""  # why the case was called at one shape only (set by the runner)
    grew_from_one: bool = False  # the second shape grows a size-1 axis: dynamo must compile again (set by the runner)

    @property
    def failed(self) -> bool:
        return self.status in ("mismatch", "crash")

    def line(self) -> str:
        text = f"{self.target}: {self.status}"
        if self.detail:
            text += f" ({self.detail})"
        return text


@dataclass
class Rerouting:
    """Eager (and float64) outputs with the tokens of ``ties`` sent to their other expert."""

    ties: tuple[Tie, ...]
    eager: Any
    float64: Any


@dataclass
class Reference:
    """Eager outputs of a module, and the same module run in float64."""

    eager: Any
    float64: Any  # None when the module cannot run in float64 (it casts to a fixed dtype)
    problem: str | None = None  # why the module cannot serve as a test (then it is skipped)
    reroutings: list[Rerouting] = field(default_factory=list)  # one per near tie of a top-k router


def first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".strip()[:300]


def _float_inputs(inputs: Sequence[Any], dtype: torch.dtype) -> tuple:
    return tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs)


class _WideGroupedMM(torch.overrides.TorchFunctionMode):
    """``torch._grouped_mm`` in float64 (aten's refuses it): one matmul per group."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch._grouped_mm or args[0].dtype != torch.float64:
            return func(*args, **kwargs)
        a, b = args[:2]
        offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
        if kwargs.get("bias") is not None or a.dim() != 2 or b.dim() != 3 or offs is None:
            return func(*args, **kwargs)  # only the MoE form (ragged rows of a, one matrix per group)
        out, start = a.new_zeros(a.shape[0], b.shape[-1]), 0
        for group, end in enumerate(offs.tolist()):
            out[start:end] = a[start:end] @ b[group]
            start = end
        return out


def _run_float64(wide: torch.nn.Module | None, inputs: Sequence[Any], pinned: list) -> Any:
    """``wide`` (the module in float64) on widened inputs, routed as ``pinned``; None when it cannot run."""
    if wide is None:
        return None
    try:
        with torch.no_grad(), _WideGroupedMM(), Router(pinned):
            return wide(*_float_inputs(inputs, torch.float64))
    except Exception:  # a model that casts to a fixed dtype cannot run widened; judge without it
        return None


def reference(module: torch.nn.Module, inputs: Sequence[Any]) -> Reference:
    router = Router()
    try:
        with torch.no_grad(), router:
            eager = module(*inputs)
    except Exception as error:
        return Reference(None, None, f"eager run failed: {first_line(error)}")
    for leaf in pytree.tree_leaves(eager):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and not torch.isfinite(leaf).all():
            return Reference(eager, None, "eager output is not finite")
    try:
        wide = copy.deepcopy(module).double()
    except Exception:
        wide = None
    ref = Reference(eager, _run_float64(wide, inputs, rerouted(router.calls, ())))
    for ties in reroutings(near_ties(router.calls, least_precise_eps(module, inputs))):
        pinned = rerouted(router.calls, ties)
        try:
            with torch.no_grad(), Router(pinned):
                other = module(*inputs)
        except Exception:
            continue  # this routing cannot run (it never happens in eager); no excuse from it
        ref.reroutings.append(Rerouting(ties, other, _run_float64(wide, inputs, pinned)))
    return ref


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def judge(got: Any, ref: Reference, dtypes: str | Sequence[str]) -> tuple[str, str, float]:
    """(status, detail, worst relative error) of ``got`` against the reference; ``dtypes``:
    the dtypes the model computes in. A mismatch that matches eager rerouted at a near tie
    of a top-k router is a ``routing tie`` (its error: against that rerouted eager)."""
    verdict = _judge(got, ref.eager, ref.float64, dtypes)
    if verdict[0] != "mismatch":
        return verdict
    for option in ref.reroutings:
        status, _, rel = _judge(got, option.eager, option.float64, dtypes)
        if status == "ok":
            ties = "; ".join(t.describe() for t in option.ties)
            routed = ", ".join(f"token {t.token} to expert {t.other}" for t in option.ties)
            return ROUTING_TIE, (f"{ties}; graphopt routed {routed} and matches eager routed so "
                                 f"(relative error {rel:.3g}); eager vs graphopt: {verdict[1]}"), rel
    return verdict


def _judge(got: Any, eager: Any, float64: Any, dtypes: str | Sequence[str]) -> tuple[str, str, float]:
    got_leaves, want_leaves = pytree.tree_leaves(got), pytree.tree_leaves(eager)
    wide_leaves = pytree.tree_leaves(float64) if float64 is not None else [None] * len(want_leaves)
    if len(got_leaves) != len(want_leaves):
        return "mismatch", f"{len(got_leaves)} outputs, eager has {len(want_leaves)}", float("inf")
    dtypes = [dtypes] if isinstance(dtypes, str) else list(dtypes)
    worst = 0.0
    for i, (g, e, w) in enumerate(zip(got_leaves, want_leaves, wide_leaves)):
        if not isinstance(e, torch.Tensor):
            continue
        if not isinstance(g, torch.Tensor) or g.shape != e.shape or g.dtype != e.dtype:
            shape = (tuple(g.shape), g.dtype) if isinstance(g, torch.Tensor) else type(g).__name__
            return "mismatch", f"output {i} is {shape}, eager gives {(tuple(e.shape), e.dtype)}", float("inf")
        if not e.is_floating_point():
            if not torch.equal(g, e):
                return "mismatch", f"output {i} (integer) differs", float("inf")
            continue
        tol = max(TOLERANCE.get(d, 0.0) for d in [*dtypes, _dtype_name(e.dtype)])
        rel = compare(g, e).rel
        worst = max(worst, rel)
        if rel <= tol:
            continue
        if w is None:
            return "mismatch", f"output {i}: relative error {rel:.3g} vs eager > {tol:g}", worst
        err_graphopt, err_eager = compare(g, w).rel, compare(e, w).rel
        if err_graphopt <= max(tol, ACCURACY_SLACK * err_eager):
            continue  # ill-conditioned in this dtype; graphopt is as close to float64 as eager
        return "mismatch", (f"output {i}: relative error {rel:.3g} vs eager > {tol:g} (vs float64: "
                            f"graphopt {err_graphopt:.3g}, eager {err_eager:.3g})"), worst
    return "ok", "", worst


@contextmanager
def quiet() -> Iterator[None]:
    """Fallback warnings are collected from the reports; keep them off the terminal."""
    log = logging.getLogger("graphopt")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def check_module(module: torch.nn.Module, inputs: Sequence[Any], target: str, pipeline: Sequence[str] | None,
                 dtypes: str | Sequence[str], ref: Reference | None = None,
                 more: Sequence[tuple[str, Sequence[Any], Reference | None]] = ()) -> Outcome:
    """Compile ``module`` with graphopt for ``target`` (falling back as a user's would),
    run it on ``inputs`` and judge its outputs against eager (``dtypes``: see :func:`judge`).
    ``more``: (label, inputs, reference) of further calls of the same compiled model at
    other shapes; the axes that differ are marked dynamic, so one compile serves them all.
    Resets dynamo and graphopt's reports first, so the outcome holds this compile's alone."""
    ref = ref or reference(module, inputs)
    if ref.problem:
        return Outcome(target, "invalid", ref.problem)
    more = [(label, xs, r or reference(module, xs)) for label, xs, r in more]
    more = [(label, xs, r) for label, xs, r in more if r.problem is None]
    if more:
        mark_dynamic(tuple(inputs), tuple(more[0][1]))
    options: dict[str, Any] = {"target": target}
    if pipeline:
        options["pipeline"] = list(pipeline)
    torch._dynamo.reset()
    graphopt.reset()
    outcome = Outcome(target, "ok", shapes=1 + len(more))
    calls = [("", inputs, ref), *more]
    results, first_graphs, where = [], 0, ""
    try:
        with quiet(), torch.no_grad():
            compiled = torch.compile(module, backend="graphopt", options=options)
            for label, xs, _ in calls:
                where = label
                results.append(compiled(*xs))
                first_graphs = first_graphs or len(graphopt.reports())
    except Exception as error:
        outcome.status, outcome.detail = "crash", (f"at {where}: " if where else "") + first_line(error)
    reports = graphopt.reports()
    first_graphs = first_graphs or len(reports)
    outcome.recompiles = len(reports) - first_graphs
    for index, report in enumerate(reports):
        outcome.fallbacks += [{"target": target, **f} for f in report.fallbacks]
        outcome.ran_on.append(report.target)
        if index >= first_graphs:
            continue  # the passes' work is counted once, on the graphs of the first call
        outcome.near_misses += report.near_misses
        for record in report.passes:
            outcome.hits[record.name] = outcome.hits.get(record.name, 0) + record.matches
    for (label, _, r), got in zip(calls, results):
        if outcome.status not in ("ok", ROUTING_TIE):
            break  # a crash, or a mismatch at an earlier shape
        status, detail, rel = judge(got, r, dtypes)
        outcome.rel_err = max(outcome.rel_err, rel)
        if status != "ok":  # a later shape's mismatch outranks an earlier shape's routing tie
            outcome.status, outcome.detail = status, f"at {label}: {detail}" if label else detail
    return outcome


def mark_dynamic(inputs: tuple[Any, ...], other: tuple[Any, ...]) -> None:
    """Tell dynamo which input axes will change, so its first compile keeps them symbolic
    (``maybe_``: a graph that must specialize one may, and then recompiles, which the
    fuzzer counts)."""
    for x, y in zip(inputs, other):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dim() == y.dim():
            for dim, (a, b) in enumerate(zip(x.shape, y.shape)):
                if a != b:
                    torch._dynamo.maybe_mark_dynamic(x, dim)
