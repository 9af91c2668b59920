"""Compile one ATen graph: run the pass pipeline, lower to a target, record a report.

Both frontends (dynamo and torch.export) end here. Failures never reach the user's
model unless ``fallback="error"``: a failing pass is skipped by the PassManager, a
target that cannot compile or run the graph hands it to the eager target, and the
report says what happened and why.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import torch.fx as fx

from graphopt import ir
from graphopt.config import Options
from graphopt.errors import BackendFailed, GraphoptError, TargetUnavailable
from graphopt.instrument import NumericCheck
from graphopt.pass_manager import Instrument, PassContext, PipelineResult
from graphopt.pipeline import build_pass_manager
from graphopt.report import CompileReport, building_for, record
from graphopt.targets import get_target, resolve_target

log = logging.getLogger("graphopt")

# The eager target runs these as their reference: the whole weight dequantized at every call.
REFERENCE_QUANTIZED_OPS = ("graphopt.int4_linear", "graphopt.int8_linear", "graphopt.int4_moe")
REFERENCE_QUANTIZED_NOTE = ("quantized weights on the eager target run the reference ops, which dequantize every "
                            "weight at each call (slower than float32: SmolLM2 decodes 2.6x slower); the onnxruntime "
                            "target (CPU) and triton (GPU) run INT4 kernels")


def run_pipeline(gm: fx.GraphModule, config: Options, example_inputs: Sequence[Any] | None,
                 instruments: Sequence[Instrument] = ()) -> tuple[PipelineResult, PassContext]:
    """Run the configured pipeline on ``gm`` (a numeric check too when asked)."""
    instruments = list(instruments)
    if config.check_numerics and example_inputs is not None:
        instruments.append(NumericCheck(example_inputs, config.tolerance))
    ctx = PassContext(config, example_inputs)
    manager = build_pass_manager(config, instruments)
    return manager.run(gm, ctx), ctx


def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any] | None, config: Options,
                  frontend: str, frozen_weights: int = 0, notes: Sequence[str] = ()) -> Callable:
    """Optimize and lower ``gm``; returns a callable taking the graph's inputs."""
    start = time.perf_counter()
    report = CompileReport(target="eager", requested_target=config.target, frontend=frontend,
                           frozen_weights=frozen_weights, nodes_in=ir.node_count(gm), notes=list(notes))
    if frontend == "dynamo" and (reason := dynamo_recompile_reason()):
        report.recompile_reason = reason
        log.info("graphopt: dynamo recompiles a graph because a guard failed: %s", reason)
    result, _ = run_pipeline(gm, config, example_inputs)
    report.passes, report.rewrites = result.records, result.rewrites
    # Screened anchors (every mul that is no gated MLP) are for `graphopt debug --why`, not the report.
    report.near_misses = [m for m in result.near_misses if not m.screened]
    report.fallbacks.extend(result.fallbacks)
    optimized = result.gm
    report.op_counts = ir.op_counts(optimized)
    report.nodes_out = ir.node_count(optimized)
    with building_for(report):  # targets record their exports / sessions / kernels on it
        compiled = lower(optimized, example_inputs, config, report)
    if report.target == "eager" and any(report.op_counts.get(op) for op in REFERENCE_QUANTIZED_OPS):
        report.notes.append(REFERENCE_QUANTIZED_NOTE)
    report.compile_s = time.perf_counter() - start
    record(report)
    return compiled


def dynamo_recompile_reason() -> str | None:
    """Why dynamo is compiling this frame again (``0/0: tensor 'input_ids' size mismatch at
    index 1. expected 5, actual 7``), from the compile's metrics; None on a first compile."""
    try:
        from torch._dynamo.utils import get_metrics_context

        context = get_metrics_context()
        return context._metrics.get("recompile_reason") if context.in_progress() else None  # noqa: SLF001
    except Exception:  # a private torch detail: without it the log line is all that is lost
        return None


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
        return eager.compile(gm, example_inputs, config)
    try:
        compiled = target.compile(gm, example_inputs, config)
    except GraphoptError as error:
        return _fall_back(gm, example_inputs, config, report, f"target:{target.name}", str(error), error)
    except Exception as error:  # a target's bug must not break the user's model
        reason = f"{type(error).__name__}: {error}"
        return _fall_back(gm, example_inputs, config, report, f"target:{target.name}", reason, error)
    report.notes.extend(getattr(compiled, "graphopt_notes", ()))  # what the target ran where (e.g. ops kept on reference)
    report.off_target_ops.extend(getattr(compiled, "graphopt_off_target_ops", ()))  # ops decomposed or kept eager
    report.near_misses.extend(getattr(compiled, "graphopt_near_misses", ()))  # the target's own rewrites' refusals
    return _guard_runtime(compiled, gm, example_inputs, config, report, target.name)


def _fall_back(gm, example_inputs, config, report, where, reason, error) -> Callable:
    if config.fallback == "error":
        raise BackendFailed(f"graphopt {where} failed: {reason}") from error
    log.warning("graphopt: %s failed (%s); running this graph on the eager target", where, reason)
    report.add_fallback(where, reason)
    report.target = "eager"
    return get_target("eager").compile(gm, example_inputs, config)


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
            reason = f"{type(error).__name__}: {error}"
            state["fn"] = _fall_back(gm, example_inputs, config, report, f"target:{target_name} (run)", reason, error)
            state["failed"] = True
            return state["fn"](*args)

    return run
