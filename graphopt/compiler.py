"""The compile front half, written once, and the hand-off to a target.

``front_half``: trace (torch.export, unless dynamo traced already) -> the pipeline at a
named stage (graphopt.pipeline owns which passes) -> the optimized graph handed to a
target's callback. torch.compile (``compile_graph``), ``graphopt export`` (graphopt/export),
the ONNX Runtime decoders and the static-cache step all go through it; the callbacks they
hand to lower the graph and run no passes.

``compile_graph`` is torch.compile's: its callback lowers on the configured target and
records a report. Failures never reach the user's model unless ``fallback="error"``: a
failing pass is skipped by the PassManager, a target that cannot compile or run the graph
hands it to the eager target, and the report says what happened and why.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Sequence, TypeVar

import torch.fx as fx

from graphopt import ir
from graphopt.config import Options, fall_back
from graphopt.errors import GraphoptError, TargetUnavailable
from graphopt.frontend.dynamo_reuse import dynamo_recompile_reason
from graphopt.frontend.trace import AtenProgram, export_aten_graph
from graphopt.instrument import NumericCheck
from graphopt.pass_manager import Instrument, PassContext, PipelineResult
from graphopt.pipeline import build_stage
from graphopt.report import CompileReport, building_for, record
from graphopt.targets import get_target, resolve_target

log = logging.getLogger("graphopt")
R = TypeVar("R")
StageTimer = Callable[[str], ContextManager[Any]]

# The eager target runs these as their reference: the whole weight dequantized at every call.
REFERENCE_QUANTIZED_OPS = ("graphopt.int4_linear", "graphopt.int8_linear", "graphopt.int4_moe")
REFERENCE_QUANTIZED_NOTE = ("quantized weights on the eager target run the reference ops, which dequantize every "
                            "weight at each call (slower than float32: SmolLM2 decodes 2.6x slower); the onnxruntime "
                            "target (CPU) and triton (GPU) run INT4 kernels")


@dataclass
class Optimized:
    """What the front half hands a target: the graph after the pipeline stage, the inputs it
    was traced on, what the passes did, and the trace (its notes, its frozen weights)."""

    gm: fx.GraphModule
    example_inputs: list | None
    result: PipelineResult
    program: AtenProgram


def front_half(source: Any, config: Options, to: Callable[[Optimized], R], *, args: Sequence[Any] = (),
               stage: str = "default", dynamic_shapes: Any = None, trace_repeated_once: bool = False,
               timer: StageTimer | None = None, trace_error: Callable[[Exception], Exception] | None = None) -> R:
    """Trace ``source`` -> run the pipeline's ``stage`` -> ``to(optimized)``, returning what ``to`` returns.

    ``source``: a module, traced here with torch.export on ``args`` (``dynamic_shapes``,
    ``trace_repeated_once`` as ``export_aten_graph`` takes them), or an ``AtenProgram`` traced
    already (dynamo's graph under torch.compile). ``timer(name)`` wraps the "torch.export"
    and "passes" steps (the export tool times its stages with it). ``trace_error``: what to
    raise instead when torch.export fails with an error that is not graphopt's own.
    """
    timer = timer or (lambda name: contextlib.nullcontext())
    if isinstance(source, AtenProgram):
        program = source
    else:
        with timer("torch.export"), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch's own pytree deprecation notices
            try:
                program = export_aten_graph(source, tuple(args), dynamic_shapes=dynamic_shapes,
                                            trace_repeated_once=trace_repeated_once)
            except GraphoptError:
                raise
            except Exception as error:
                if trace_error is None:
                    raise
                raise trace_error(error) from error
    inputs = list(program.example_inputs) if program.example_inputs is not None else None
    with timer("passes"):
        result, _ = run_pipeline(program.gm, config, inputs, stage=stage)
    return to(Optimized(result.gm, inputs, result, program))


def run_pipeline(gm: fx.GraphModule, config: Options, example_inputs: Sequence[Any] | None,
                 instruments: Sequence[Instrument] = (), stage: str = "default") -> tuple[PipelineResult, PassContext]:
    """Run the pipeline's ``stage`` on ``gm`` (a numeric check too when asked); the context
    returned is the last phase's."""
    checks = list(instruments)
    if config.check_numerics and example_inputs is not None:
        checks.append(NumericCheck(example_inputs, config.tolerance))
    result, ctx = PipelineResult(gm, [], [], [], []), None
    for phase in build_stage(config, stage, checks):  # a phase that changes the inputs gets no checks
        ctx = PassContext(config, example_inputs if phase.replays_inputs else None)
        step = phase.manager.run(result.gm, ctx)
        result = PipelineResult(step.gm, result.records + step.records, result.near_misses + step.near_misses,
                                result.fallbacks + step.fallbacks, result.rewrites + step.rewrites)
    return result, ctx


def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any] | None, config: Options,
                  frontend: str, frozen_weights: int = 0, notes: Sequence[str] = ()) -> Callable:
    """torch.compile's hand-off: optimize ``gm`` through the front half, lower it on the
    configured target and record the report; returns a callable taking the graph's inputs."""
    start = time.perf_counter()
    report = CompileReport(target="eager", requested_target=config.target, frontend=frontend,
                           frozen_weights=frozen_weights, nodes_in=ir.node_count(gm), notes=list(notes))
    if frontend == "dynamo" and (reason := dynamo_recompile_reason()):
        report.recompile_reason = reason
        log.info("graphopt: dynamo recompiles a graph because a guard failed: %s", reason)
    traced = AtenProgram(gm, example_inputs, None, frozen_weights, list(notes))
    compiled = front_half(traced, config, lambda optimized: lower_reported(optimized, config, report))
    report.compile_s = time.perf_counter() - start
    record(report)
    return compiled


def lower_reported(optimized: Optimized, config: Options, report: CompileReport) -> Callable:
    """torch.compile's target callback: what the passes did onto ``report``, then the
    optimized graph lowered on the configured target."""
    note_pipeline(report, optimized.result)
    with building_for(report):  # targets record their exports / sessions / kernels on it
        compiled = lower(optimized.gm, optimized.example_inputs, config, report)
    if report.target == "eager" and any(report.op_counts.get(op) for op in REFERENCE_QUANTIZED_OPS):
        report.notes.append(REFERENCE_QUANTIZED_NOTE)
    return compiled


def note_pipeline(report: CompileReport, result: PipelineResult) -> None:
    """What the passes did, onto ``report``: records, rewrites, near misses, fallbacks, the op counts."""
    report.passes, report.rewrites = result.records, result.rewrites
    # Screened anchors (every mul that is no gated MLP) are for `graphopt debug --why`, not the report.
    report.near_misses = [m for m in result.near_misses if not m.screened]
    report.fallbacks.extend(result.fallbacks)
    report.op_counts = ir.op_counts(result.gm)
    report.nodes_out = ir.node_count(result.gm)


def lower(gm: fx.GraphModule, example_inputs: Sequence[Any] | None, config: Options,
          report: CompileReport) -> Callable:
    """Compile on the configured target; fall back to eager (reported) when it cannot."""
    if config.record_routing:  # off: the graph and the callable stay as they are
        from graphopt.routing import lower_recording_routing

        return lower_recording_routing(gm, lambda g: _lower(g, example_inputs, config, report), report)
    return _lower(gm, example_inputs, config, report)


def _lower(gm: fx.GraphModule, example_inputs: Sequence[Any] | None, config: Options,
           report: CompileReport) -> Callable:
    eager = get_target("eager")
    try:
        target, skipped = resolve_target(config)
        report.notes.extend(f"auto skipped {s}" for s in skipped)
    except TargetUnavailable as error:
        return _fall_back(gm, example_inputs, config, report, "target", str(error), error)
    report.target = target.name
    if target is eager:
        return eager.compile(gm, example_inputs, config).fn
    try:
        compiled = target.compile(gm, example_inputs, config)
    except GraphoptError as error:
        return _fall_back(gm, example_inputs, config, report, f"target:{target.name}", str(error), error)
    except Exception as error:  # a target's bug must not break the user's model
        reason = f"{type(error).__name__}: {error}"
        return _fall_back(gm, example_inputs, config, report, f"target:{target.name}", reason, error)
    report.notes.extend(compiled.notes)  # what the target ran where (e.g. ops kept on reference)
    report.off_target_ops.extend(compiled.off_target_ops)  # ops decomposed or kept eager
    report.near_misses.extend(compiled.near_misses)  # the target's own rewrites' refusals
    return _guard_runtime(compiled.fn, gm, example_inputs, config, report, target.name)


def _fall_back(gm, example_inputs, config, report, where, reason, error) -> Callable:
    fall_back(config, error, where, "running this graph on the eager target", reason=reason)
    report.add_fallback(where, reason)
    report.target = "eager"
    return get_target("eager").compile(gm, example_inputs, config).fn


def _guard_runtime(compiled: Callable, gm: fx.GraphModule, example_inputs, config: Options,
                   report: CompileReport, target_name: str) -> Callable:
    """Run ``compiled``; if it raises, switch this graph to eager for good (reported)."""
    state = {"fn": compiled, "failed": False}

    def run(*args: Any) -> Any:
        if state["failed"]:
            return state["fn"](*args)
        try:
            return state["fn"](*args)
        except Exception as error:
            from graphopt.distributed.failures import collective_failed

            if collective_failed(error):  # a broken process group: the launcher names the rank and collective
                raise
            reason = f"{type(error).__name__}: {error}"
            state["fn"] = _fall_back(gm, example_inputs, config, report, f"target:{target_name} (run)", reason, error)
            state["failed"] = True
            return state["fn"](*args)

    return run
