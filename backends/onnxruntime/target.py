"""The ``onnxruntime`` target: run an optimized graph in an ONNX Runtime InferenceSession.

``torch.compile(m, backend="graphopt", options={"target": "onnxruntime", "provider": "cpu"})``.
The graph is exported with graphopt ops as ORT's fused ops (``export.py``) and run through
``session.SessionRunner``. A graph that cannot be exported raises ``UnsupportedOp`` /
``OnnxExportError`` naming the op, and the core's ``lower()`` runs it eagerly instead, with
a warning and a report entry.

Shapes: one export and one session per graph, at compile time, so an export problem shows
up there. A graph with static shapes is exported static (ORT plans its memory once). A graph
with symbolic sizes (dynamo's automatic-dynamic recompile after a second shape,
``dynamic=True``, ``mark_dynamic``) is exported once with those axes dynamic and serves every
shape from one session: the SymInt inputs a dynamo graph takes (``s0``) are read from the
tensor input axis of the same size inside the model, a SymInt that is no input axis's size
(a counter in a KV cache object) is an input of its own, and SymInt outputs are computed from
the run's inputs. Only where that cannot work (a SymFloat input, or an export that fails with
dynamic axes) does the graph fall back to one static model per input signature
(``_PerSignature``, up to ``MAX_SPECIALIZATIONS``), with a warning and a note.
Every export + session is a build in the graph's report. A later graph that is a dynamic
graph's instance (dynamo's batch-of-1 recompile: ``s0 = 1``) runs on that graph's session,
with no build and a note (``reuse.py``).

``STRATEGIES`` is each of these ways of compiling a graph, by name, with when it applies; the
first that applies builds the graph's ``Compiled`` (its callable and the report's notes).
"""

from __future__ import annotations

import importlib.util
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from graphopt import report as reports
from graphopt.backends.onnxruntime.compile import reuse
from graphopt.backends.onnxruntime.runtime.bound_outputs import BoundOutputs
from graphopt.backends.onnxruntime.runtime.graph_runner import graph_runner, laid_out_as_session, output_specs
from graphopt.backends.onnxruntime.runtime.heap_trim import release_free_heap
from graphopt.backends.onnxruntime.compile.lazy_build import INTS_NOTE, NOTE, BuildOnSecondCall, build_on_second_call
from graphopt.backends.onnxruntime.lower.signatures import PerSignature, SizePlan, inputs_from_meta, shapes_of
from graphopt.frontend import graph_instance
from graphopt.ir import is_symbolic_size
from graphopt.targets import Compiled

REQUIRED_PACKAGES = ("onnxruntime", "onnx", "onnxscript", "onnx_ir")
MAX_SPECIALIZATIONS = 8
log = logging.getLogger("graphopt")


def missing_package() -> str | None:
    """The first package this target needs that is not installed, or None."""
    for name in REQUIRED_PACKAGES:
        if importlib.util.find_spec(name) is None:
            return name.replace("_", "-")
    return None


class OnnxRuntimeTarget:
    name = "onnxruntime"

    @property
    def exporter(self):
        """What ``graphopt export`` (graphopt/export) lowers and checks its files with; runs no pass."""
        from graphopt.backends.onnxruntime.exporter import onnx_exporter

        return onnx_exporter

    def unavailable_reason(self, config) -> str | None:
        missing = missing_package()
        if missing:
            return f"needs the Python package {missing!r}: pip install 'graphopt[onnxruntime]'"
        from graphopt.backends.onnxruntime.runtime.session import provider_problem

        return provider_problem(config.provider)

    def compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any] | None, config) -> Compiled:
        for strategy in STRATEGIES:
            found = strategy.applies(gm, example_inputs, config)
            if found is not None and found is not False:
                compiled = strategy.build(self, gm, example_inputs, config, found)
                compiled.strategy = compiled.strategy or strategy.name
                return compiled
        raise AssertionError("the last strategy applies to every graph")


@dataclass(frozen=True)
class Strategy:
    """One way to compile a graph: ``applies(gm, example_inputs, config)`` is None or False when
    it does not apply, else what it found, handed to ``build(target, gm, example_inputs, config,
    found) -> Compiled``."""

    name: str
    summary: str
    applies: Callable[..., Any]
    build: Callable[..., Compiled]


def _unplanned(gm, example_inputs, config) -> bool:
    from graphopt.backends.onnxruntime.lower import partition

    return not partition.is_partition(gm)


def _partitioned(target, gm, example_inputs, config, found) -> Compiled:
    from graphopt.backends.onnxruntime.lower import partition

    return partition.compile_partitioned(target, gm, example_inputs, config)


def _earlier_serves(gm, example_inputs, config) -> Compiled | None:
    return _serve_from_earlier(gm, config.provider)


def _reused(target, gm, example_inputs, config, served: Compiled) -> Compiled:
    log.info("graphopt: %s", served.notes[0])
    served.fn = _retirable(gm, config.provider, served.fn)
    return served


def _static_without_inputs(gm, example_inputs, config) -> bool:
    return not _has_symbolic_shapes(gm) and _static_inputs(gm, example_inputs) is None


def _per_signature_without_inputs(target, gm, example_inputs, config, found) -> Compiled:
    return _per_signature(gm, config.provider, "its inputs carry no example values")


def _static_recompile(gm, example_inputs, config) -> bool:
    return not _has_symbolic_shapes(gm) and config.lazy_recompiles and _recompiled()


def _static_at_second_call(target, gm, example_inputs, config, found) -> Compiled:
    lazy = _compile_at_second_call(gm, _static_build(gm, config.provider))
    return Compiled(_retirable(gm, config.provider, lazy.fn), lazy.notes)


def _static(gm, example_inputs, config) -> bool:
    return not _has_symbolic_shapes(gm)


def _build_static(target, gm, example_inputs, config, found) -> Compiled:
    compiled = _compile_static(gm, _static_inputs(gm, example_inputs), config.provider)
    compiled.fn = _retirable(gm, config.provider, compiled.fn)
    return compiled


def _symbolic_ints_recompile(gm, example_inputs, config) -> bool:
    # Only int inputs are symbolic (a sliding-window cache's counters, which dynamo made
    # dynamic when they changed): its tensors have one shape, and like a static
    # recompile it is most often called once (Gemma 3's first decode step).
    return config.lazy_recompiles and _recompiled() and not _has_symbolic_tensor_sizes(gm)


def _symbolic_at_second_call(target, gm, example_inputs, config, found) -> Compiled:
    build = lambda args, report: _compile_symbolic(gm, config.provider, report)  # noqa: E731
    return _compile_at_second_call(gm, build, INTS_NOTE)


def _always(gm, example_inputs, config) -> bool:
    return True


def _build_symbolic(target, gm, example_inputs, config, found) -> Compiled:
    return _compile_symbolic(gm, config.provider)


# In order: the first that applies compiles the graph.
STRATEGIES = (
    Strategy("partition", "decompose what has no translation, cut off what cannot export, compile each part",
             _unplanned, _partitioned),
    Strategy("reuse", "an instance of an earlier dynamic graph runs on that graph's session, no build",
             _earlier_serves, _reused),
    Strategy("per_signature", "static shapes with no example inputs: one static export per input shape seen",
             _static_without_inputs, _per_signature_without_inputs),
    Strategy("static_at_second_call", "dynamo's static recompile: torch at its first call, a static session at "
             "its second", _static_recompile, _static_at_second_call),
    Strategy("static", "static shapes: one static export and session, memory planned once", _static, _build_static),
    Strategy("symbolic_ints_at_second_call", "only int inputs symbolic after a recompile: torch at its first call, "
             "the dynamic build at its second", _symbolic_ints_recompile, _symbolic_at_second_call),
    Strategy("symbolic", "one export with the symbolic axes dynamic, one session for every shape", _always,
             _build_symbolic),
)


def _static_inputs(gm: fx.GraphModule, example_inputs) -> list | None:
    return list(example_inputs) if example_inputs is not None else inputs_from_meta(gm)


def _recompiled() -> bool:
    """Whether dynamo is compiling this graph again after a guard failed (``lazy_build.py``)."""
    report = reports.current_report()
    return report is not None and report.recompile_reason is not None


def _compile_at_second_call(gm: fx.GraphModule, build: Callable[[list, Any], Compiled], note: str = NOTE) -> Compiled:
    """``gm`` on torch for its first call, then ``build(args, report)`` (lazy_build.py)."""
    # The report is gone from the context by the second call: the build is recorded on it.
    lazy = build_on_second_call(gm, _build_at_call(build, reports.current_report()), laid_out_as_session(gm))
    return Compiled(lazy, [note])


def _static_build(gm: fx.GraphModule, provider: str) -> Callable[[list, Any], Compiled]:
    return lambda args, report: _compile_static(gm, args, provider, report)


def _build_at_call(build: Callable[[list, Any], Compiled], report) -> Callable[[list], Callable]:
    """``build(args, report)`` run during a call, with that call's tensors. In a fresh thread:
    a call runs inside aot_autograd's runtime wrapper, whose thread-local dispatch state breaks
    the export (as for PerSignature). What the build has to say goes into the report itself:
    compile time, when the core copies a Compiled's notes, has passed."""
    def at_call(args: list) -> Callable:
        with ThreadPoolExecutor(max_workers=1) as pool:
            built = pool.submit(build, args, report).result()
        if report is not None:
            report.notes.extend(built.notes)
        return built.fn

    return at_call


def _input_values(gm: fx.GraphModule) -> list:
    return [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]


def _has_symbolic_tensor_sizes(gm: fx.GraphModule) -> bool:
    """Whether a tensor input has a symbolic size (not only a SymInt input)."""
    return any(isinstance(val, torch.Tensor) and any(map(is_symbolic_size, val.shape)) for val in _input_values(gm))


def _has_symbolic_shapes(gm: fx.GraphModule) -> bool:
    """Whether a tensor input has a symbolic size or a SymInt input is symbolic."""
    return _has_symbolic_tensor_sizes(gm) or any(map(is_symbolic_size, _input_values(gm)))


def _build_session(gm: fx.GraphModule, example_inputs: list, provider: str, *, dynamic: bool,
                   sizes_from: dict | None = None, scalars: list[int] | None = None, report=None,
                   arena: bool | None = None):
    """Export ``gm`` and open its session; record the build on the graph's report."""
    from graphopt.backends.onnxruntime.lower.export import export_graph
    from graphopt.backends.onnxruntime.runtime.session import create_session, session_passes

    report = report or reports.current_report()
    start = time.perf_counter()
    # In a fresh thread: torch.export (the traced route) would otherwise pick up dynamo's
    # tracing context and fake mode (thread-locals) and add its symbols and guards to the
    # graph being compiled; the direct route turns guards off for its own thread only.
    # No onnxscript pattern rewrites: this model only ever feeds the session below, whose
    # optimizer makes the same rewrites, and their matcher is quadratic in the graph's nodes
    # (SmolLM2's dynamic export: 30 -> 14 s, and 41 -> 19 s once the batch is dynamic too).
    # Attention's layout round trips go, which ORT's optimizer leaves (export_graph's docstring).
    with ThreadPoolExecutor(max_workers=1) as pool:
        model = pool.submit(export_graph, gm, example_inputs, dynamic=dynamic, sizes_from=sizes_from,
                            scalars=scalars or (), tidy_attention=True).result()
    exported = time.perf_counter()
    session = create_session(model, provider, arena=not dynamic if arena is None else arena, feed_weights=True)
    done = time.perf_counter()
    release_free_heap()  # the export ran in its own thread, whose glibc arena keeps what it freed
    shapes, dims = shapes_of(gm, example_inputs if not dynamic else None)
    if report is not None:
        for passes in (model.passes, session_passes(session)):  # the export's, then the session bytes'
            report.record_target_passes(passes.records, passes.near_misses)
        report.record_build("onnxruntime session", shapes, dims, done - start,
                            export_s=round(exported - start, 4), session_s=round(done - exported, 4),
                            export_route=model.route)
    return model, session


def _compile_static(gm: fx.GraphModule, example_inputs: list, provider: str, report=None) -> Compiled:
    from graphopt.backends.onnxruntime.runtime.session import SessionRunner

    model, session = _build_session(gm, example_inputs, provider, dynamic=False, report=report)
    return Compiled(graph_runner(gm, model, session, SessionRunner(session, output_specs(gm)), example_inputs, None))


def _compile_symbolic(gm: fx.GraphModule, provider: str, report=None) -> Compiled:
    """One export with the symbolic axes dynamic, one session for every shape. ``report``:
    the graph's, when this runs at a call instead of at compile time (lazy_build.py)."""
    from graphopt.backends.onnxruntime.errors import OnnxExportError
    from graphopt.backends.onnxruntime.runtime.session import SessionRunner

    report = report or reports.current_report()
    plan = SizePlan.of(gm)
    if plan.problem:
        return _per_signature(gm, provider, plan.problem, report)
    inputs = inputs_from_meta(gm)
    if inputs is None:
        return _per_signature(gm, provider, "an input has no fake value to size an example from", report)
    # With outputs it can bind, the session keeps ORT's arena and shrinks it after each run.
    bound = BoundOutputs.of(gm, plan) if provider == "cpu" else None
    # Static graphs this one will take over drop their sessions before the build. Should the
    # build fail, or not take one over after all, that graph builds its own again when called.
    if reuse.release_static_instances(gm, provider, lambda g: not _has_symbolic_shapes(g), _rebuild_when_called):
        release_free_heap()
    try:
        model, session = _build_session(gm, inputs, provider, dynamic=True, sizes_from=plan.sizes_from,
                                        scalars=plan.scalars, report=report, arena=bound is not None)
    except OnnxExportError as error:
        return _per_signature(gm, provider, f"the export with dynamic axes failed ({error})", report)
    run = graph_runner(gm, model, session, SessionRunner(session, None), inputs, plan, bound=bound,
                  release=bound is not None)
    entry = reuse.remember(gm, model, session, provider, owner=run)
    # Graphs compiled before this one that are its instances move onto this session.
    if reuse.retire_instances(provider, lambda earlier_gm: _served_fn(_serve_from_earlier(earlier_gm, provider,
                                                                                            only=entry))):
        release_free_heap()  # the retired sessions' weights and arenas
    return Compiled(_retirable(gm, provider, run, report))


def _served_fn(served: Compiled | None) -> Callable | None:
    return served.fn if served is not None else None


def _rebuild_when_called(earlier: reuse.Retirable) -> Callable:
    """A released static graph's stand-in: it builds the graph's own session at its next call."""
    return BuildOnSecondCall(None, _build_at_call(_static_build(earlier.gm, earlier.provider), earlier.report))


def _retirable(gm: fx.GraphModule, provider: str, run: Callable, report=None) -> Callable:
    return reuse.retirable(gm, provider, run, report or reports.current_report())


def _serve_from_earlier(gm: fx.GraphModule, provider: str, only: reuse.Earlier | None = None) -> Compiled | None:
    """``gm`` run on the session of an earlier dynamic graph it is an instance of (``only``
    that one, when given), with a note that says so, or None."""
    from graphopt.backends.onnxruntime.runtime.session import SessionRunner

    found = reuse.find(gm, provider, only=only)
    if found is None:
        return None
    earlier, binding = found
    if earlier.model.scalar_inputs:  # its session takes sizes as inputs that this graph may have fixed
        return None
    plan = SizePlan.of(gm) if _has_symbolic_shapes(gm) else None
    if plan is not None and plan.problem:
        return None
    outputs = gm.graph.output_node().args[0]
    outputs = outputs if isinstance(outputs, (tuple, list)) else [outputs]
    output_plan = []
    for position, (p, out) in enumerate(zip(earlier.model.output_plan, outputs)):
        if isinstance(p, tuple) and p[0] == "sym":  # a size: this graph's own, from its own inputs
            val = out.meta.get("val") if isinstance(out, fx.Node) else out
            p = ("sym", position) if plan is not None and position in plan.outputs else ("const", int(val))
        output_plan.append(p)
    placeholders = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    arena = getattr(earlier.session, "_graphopt_arena", False)
    bound = BoundOutputs.of(gm, plan or SizePlan.of(gm)) if arena else None
    run = graph_runner(gm, earlier.model, earlier.session, SessionRunner(earlier.session, None), placeholders, plan,
                  output_plan, bound=bound, release=arena)
    run.graphopt_reusable = earlier  # this callable keeps the session alive too
    message = (f"onnxruntime: no export: this graph is an earlier dynamic graph with {graph_instance.describe(binding)} "
               "(dynamo's recompile), and that graph's session serves it")
    return Compiled(run, [message])


def _per_signature(gm: fx.GraphModule, provider: str, reason: str, report=None) -> Compiled:
    log.warning("graphopt: onnxruntime exports this graph once per input shape (up to %d kept): %s",
                MAX_SPECIALIZATIONS, reason)
    fn = PerSignature(gm, lambda g, args, report: _compile_static(g, args, provider, report).fn,
                      report or reports.current_report(), MAX_SPECIALIZATIONS)
    return Compiled(fn, [f"onnxruntime: one static export per input shape, since {reason}"], strategy="per_signature")


onnxruntime = OnnxRuntimeTarget()
