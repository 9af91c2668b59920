"""The pass protocol and the PassManager that runs a pipeline of passes.

A pass is one object with ``name``, a one-line ``summary``, an ``Options`` dataclass,
``requires`` (passes that must run before it) and ``run(gm, ctx) -> PassResult``.
Everything around the passes (timing, printing, verification, numeric checks,
disabling, the bisect limit, falling back on failure) lives here and in
``graphopt.instrument``, never inside a pass.

This module knows no pass by name: the registry (graphopt.registry) and the default
pipeline (graphopt.pipeline, which also builds a PassManager from Options) import it,
never the reverse.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

import torch.fx as fx

from graphopt import ir
from graphopt.config import Options, fall_back
from graphopt.errors import OptionsError, PassFailed

log = logging.getLogger("graphopt")


@dataclass
class NoOptions:
    """Options of a pass that takes none."""


@dataclass
class NearMiss:
    """A candidate a pass looked at and did not rewrite, with the reason."""

    pass_name: str
    anchor: str  # the node the match started from
    node: str  # the node where matching stopped
    reason: str
    # True when a cheap screen dismissed the anchor before matching (a mul with no
    # activation operand is no gated MLP): kept for --why, which groups them by reason,
    # but not counted as a near miss in the pass's record.
    screened: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class PassResult:
    gm: fx.GraphModule
    modified: bool
    stats: dict[str, int] = field(default_factory=dict)  # at least "matches"
    near_misses: list[NearMiss] = field(default_factory=list)


@runtime_checkable
class Pass(Protocol):
    name: str
    summary: str
    Options: type
    requires: tuple[str, ...]

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult: ...


@dataclass
class Rewrite:
    """One rewrite a pass made, numbered across the whole pipeline (for bisecting)."""

    index: int
    pass_name: str
    node: str
    target: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class PassContext:
    """What a pass may ask of the pipeline: its options and permission to rewrite."""

    def __init__(self, config: Options | None = None, example_inputs: Sequence[Any] | None = None):
        self.config = config or Options()
        self.example_inputs = example_inputs
        self.rewrites: list[Rewrite] = []
        self._rewrite_count = 0
        self._pass_options: dict[str, Any] = {}

    def options_for(self, p: Pass) -> Any:
        """The pass's Options instance, built from ``config.pass_options[p.name]``."""
        if p.name not in self._pass_options:
            self._pass_options[p.name] = build_pass_options(p, self.config.pass_options.get(p.name, {}))
        return self._pass_options[p.name]

    def allow_rewrite(self, pass_name: str, node: fx.Node) -> bool:
        """Count one rewrite; False once the bisect limit is spent (LLVM's opt-bisect-limit)."""
        self._rewrite_count += 1
        limit = self.config.bisect_limit
        if 0 <= limit < self._rewrite_count:
            return False
        self.rewrites.append(Rewrite(self._rewrite_count, pass_name, node.name, ir.target_name(node.target)))
        return True

    @property
    def rewrite_count(self) -> int:
        return self._rewrite_count


@dataclass
class PassRecord:
    """What one pass did in one pipeline run; ``to_dict`` is part of the report."""

    name: str
    status: str = "unchanged"  # changed | unchanged | failed | disabled
    matches: int = 0
    time_ms: float = 0.0
    nodes_before: int = 0
    nodes_after: int = 0
    stats: dict[str, int] = field(default_factory=dict)
    near_misses: int = 0
    error: str | None = None
    numerics: dict[str, float] | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class PipelineResult:
    gm: fx.GraphModule
    records: list[PassRecord]
    near_misses: list[NearMiss]
    fallbacks: list[dict]
    rewrites: list[Rewrite]


def build_pass_options(p: Pass, given: dict) -> Any:
    """``p.Options(**given)``, or OptionsError naming the valid keys."""
    valid = {f.name for f in dataclasses.fields(p.Options)}
    unknown = set(given) - valid
    if unknown:
        raise OptionsError(
            f"unknown option(s) {', '.join(sorted(unknown))} for pass {p.name}; "
            f"valid: {', '.join(sorted(valid)) or 'none'}"
        )
    try:
        return p.Options(**given)
    except (TypeError, ValueError) as error:
        raise OptionsError(f"bad options for pass {p.name}: {error}") from error


def options_schema(p: Pass) -> list[dict[str, Any]]:
    """``[{name, type, default, help}]`` for each field of ``p.Options``; ``help`` is the
    field's ``metadata["help"]`` (``field(default=..., metadata={"help": "one line"})``),
    None where the pass gives none."""
    rows = []
    for f in dataclasses.fields(p.Options):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None  # required: the pass cannot be built without it
        kind = f.type.__name__ if isinstance(f.type, type) else str(f.type)  # a string under postponed annotations
        rows.append({"name": f.name, "type": kind, "default": default, "help": f.metadata.get("help")})
    return rows


class Instrument:
    """Hooks the PassManager calls around each pass. Subclass and override what you need."""

    def before_pass(self, p: Pass, gm: fx.GraphModule, ctx: PassContext) -> None: ...

    def after_pass(self, p: Pass, before: fx.GraphModule, after: fx.GraphModule,
                   record: PassRecord, ctx: PassContext) -> None: ...

    def after_failure(self, p: Pass, gm: fx.GraphModule, error: BaseException,
                      record: PassRecord, ctx: PassContext) -> None: ...


class PassManager:
    """Runs passes in order on a copy of the graph, with instrumentation and fallback."""

    def __init__(self, passes: Sequence[Pass], instruments: Sequence[Instrument] = (),
                 disabled: Sequence[str] = (), verify: bool = True, fallback: str = "eager"):
        self.passes = list(passes)
        self.instruments = list(instruments)
        self.disabled = set(disabled)
        self.verify = verify
        self.fallback = fallback
        check_preconditions([p for p in self.passes if p.name not in self.disabled])

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PipelineResult:
        """The pipeline on ``gm``, which is left as it was.

        With no instruments the passes rewrite one copy of the graph in turn; should one
        fail, the pipeline runs again from ``gm`` with a copy per pass, which is how it
        always runs under instruments (they keep or compare the graph around each pass):
        a pass that fails half-way then leaves the previous pass's graph intact and is
        skipped. A copy per pass cost SmolLM2-135M's first torch.compile'd generate 11 s
        of its 17 s in passes (fx's node copies, about 20 us a node, and the collector)."""
        if self.instruments:
            return self._run(gm, ctx, copy_each=True)
        rewrites, count = list(ctx.rewrites), ctx.rewrite_count
        try:
            return self._run(ir.copy_graph_module(gm), ctx, copy_each=False)
        except _PassBroke:
            ctx.rewrites[:], ctx._rewrite_count = rewrites, count  # as if the first try never ran
            return self._run(gm, ctx, copy_each=True)

    def _run(self, gm: fx.GraphModule, ctx: PassContext, copy_each: bool) -> PipelineResult:
        records, near_misses, fallbacks = [], [], []
        for p in self.passes:
            record = PassRecord(p.name, nodes_before=ir.node_count(gm))
            records.append(record)
            if p.name in self.disabled:
                record.status, record.nodes_after = "disabled", record.nodes_before
                continue
            gm = self._run_one(p, gm, ctx, record, near_misses, fallbacks, copy_each)
        return PipelineResult(gm, records, near_misses, fallbacks, list(ctx.rewrites))

    def _run_one(self, p: Pass, gm: fx.GraphModule, ctx: PassContext, record: PassRecord,
                 near_misses: list, fallbacks: list, copy_each: bool) -> fx.GraphModule:
        for inst in self.instruments:
            inst.before_pass(p, gm, ctx)
        work = ir.copy_graph_module(gm) if copy_each else gm
        start = time.perf_counter()
        try:
            result = p.run(work, ctx)
            if self.verify and result.modified:
                ir.verify_graph(result.gm)
        except Exception as error:  # a broken pass must not break the user's model
            if not copy_each:
                raise _PassBroke() from error  # the graph is half-rewritten: start again with copies
            record.time_ms = (time.perf_counter() - start) * 1e3
            record.status, record.nodes_after = "failed", record.nodes_before
            record.error = f"{type(error).__name__}: {error}"
            log.debug("pass %s failed:\n%s", p.name, traceback.format_exc())
            for inst in self.instruments:
                inst.after_failure(p, work, error, record, ctx)
            fall_back(self.fallback, error, f"pass {p.name}", "skipped it", reason=record.error, raise_as=PassFailed)
            fallbacks.append({"where": f"pass:{p.name}", "reason": record.error})
            return gm
        record.time_ms = (time.perf_counter() - start) * 1e3
        record.stats = dict(result.stats)
        record.matches = int(result.stats.get("matches", 0))
        record.near_misses = sum(not m.screened for m in result.near_misses)
        record.status = "changed" if result.modified else "unchanged"
        record.nodes_after = ir.node_count(result.gm)
        near_misses.extend(result.near_misses)
        for inst in self.instruments:
            inst.after_pass(p, gm, result.gm, record, ctx)
        return result.gm


class _PassBroke(Exception):
    """A pass failed on the shared copy (PassManager.run's first try)."""


def check_preconditions(passes: Sequence[Pass]) -> None:
    """Each pass's ``requires`` must appear earlier in the pipeline; say which is missing."""
    seen: set[str] = set()
    for p in passes:
        missing = [r for r in getattr(p, "requires", ()) if r not in seen]
        if missing:
            raise OptionsError(
                f"pass {p.name} needs {', '.join(missing)} to run before it; "
                f"put {'it' if len(missing) == 1 else 'them'} earlier in the pipeline or disable {p.name}"
            )
        seen.add(p.name)
