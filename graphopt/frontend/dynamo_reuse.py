"""Serve dynamo's retrace of a dynamic graph with the code already compiled for it.

Dynamo never treats a size of 1 as dynamic: after a model has run at batches 2 and 4 its
graph has a dynamic batch guarded ``2 <= batch``, and a batch of 1 makes dynamo trace the
frame again with the batch fixed at 1. The new graph is the dynamic one with ``s0 = 1``, and
the code compiled for the dynamic graph computes it (its sizes are read at run time). Before
this module, that retrace went through AOT autograd's two fake-tensor traces and graphopt's
passes again (about 3.5 of the 4.8 s of llama-small's third call) only to reach code that
already existed (the onnxruntime target then reused the session: ``backends/onnxruntime/compile/reuse.py``).

``serve`` proves the new dynamo graph an instance of a remembered dynamic one
(``graph_instance.instance_of`` over ``example_value``) and returns a callable that passes
its inputs to the earlier compiled code, with the bound sizes filled in. It declines (None)
when anything differs:

- the options the graph is compiled with;
- any op, constant or size the binding does not explain;
- a module's parameter or buffer, or a tensor that is not a top-level argument of the
  call: the earlier code froze those as constants, so the new graph must read the very
  same tensors (a replaced weight compiles again);
- an input that is neither a tensor nor an integer size.

A served graph gets a report with the earlier graph's op counts and a note naming it; it
adds no build.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import sympy
import torch
import torch.fx as fx

from graphopt.frontend import graph_instance
from graphopt.report import CompileReport, record

log = logging.getLogger("graphopt")
KEY = "example_value"  # where dynamo keeps each node's fake value


@dataclass
class _Compiled:
    """What the code compiled for a dynamic graph was compiled from. It hangs off that code
    (``graphopt_dynamo_reuse``) and holds no reference back, so dropping the code (dynamo's
    reset) frees both at once, without waiting for a garbage collection."""

    gm: fx.GraphModule
    config: Any  # Options
    frozen: dict[int, weakref.ref]  # placeholder index -> the tensor the compiled code holds
    report: CompileReport | None
    shape: tuple


_compiled: list[weakref.ref] = []  # the compiled callables that carry a _Compiled


def remember(gm: fx.GraphModule, example_inputs: Sequence[Any], compiled: Callable, config: Any,
             report: CompileReport | None) -> None:
    """Keep a graph with symbolic sizes for later retraces, as long as ``compiled`` lives."""
    placeholders = _placeholders(gm)
    if not any(_is_symbolic(n.meta.get(KEY)) for n in placeholders) or len(placeholders) != len(example_inputs):
        return
    frozen = {}
    for index, (node, example) in enumerate(zip(placeholders, example_inputs)):
        if isinstance(example, torch.Tensor) and not _passed_at_run_time(node, example):
            frozen[index] = weakref.ref(example)
    try:
        compiled.graphopt_dynamo_reuse = _Compiled(gm, config, frozen, report, graph_instance.shape(gm, KEY))
        _compiled.append(weakref.ref(compiled))
    except (AttributeError, TypeError):  # a callable that takes no attribute or weak reference
        return


def serve(gm: fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> Callable | None:
    """A callable for ``gm`` that runs earlier compiled code, or None (compile as usual)."""
    try:
        return _serve(gm, example_inputs, config)
    except Exception:  # the proof is an optimisation: a graph it cannot read compiles as before
        log.debug("graphopt: could not compare this graph with earlier dynamic ones", exc_info=True)
        return None


def _serve(gm: fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> Callable | None:
    _compiled[:] = [ref for ref in _compiled if ref() is not None]
    if not _compiled or len(_placeholders(gm)) != len(example_inputs):
        return None
    shape = graph_instance.shape(gm, KEY)
    for ref in reversed(_compiled):
        compiled = ref()
        entry = getattr(compiled, "graphopt_dynamo_reuse", None)
        if entry is None or entry.shape != shape or entry.config != config:
            continue
        binding = graph_instance.instance_of(entry.gm, gm, KEY)
        if binding is None:
            continue
        plan = _argument_plan(entry, binding, gm, example_inputs)
        if plan is None:
            continue
        return _served(compiled, entry, plan, binding, config)
    return None


def _argument_plan(entry: _Compiled, binding: dict, gm: fx.GraphModule,
                   example_inputs: Sequence[Any]) -> list[tuple[str, Any]] | None:
    """For each input of the earlier graph: ("arg", index into the new call's arguments) or
    ("const", value); None when an input cannot be supplied."""
    placeholders = _placeholders(gm)
    new_tensors = graph_instance.tensor_inputs(gm, KEY)
    earlier_tensors = graph_instance.tensor_inputs(entry.gm, KEY)
    position = {node: i for i, node in enumerate(placeholders)}
    paired = dict(zip(earlier_tensors, new_tensors))
    new_sizes = {}  # a plain symbol of the new graph -> the argument that carries it
    for i, node in enumerate(placeholders):
        val = node.meta.get(KEY)
        if isinstance(val, torch.SymInt) and val.node.expr.is_Symbol:
            new_sizes[val.node.expr] = i
    plan: list[tuple[str, Any]] = []
    for index, node in enumerate(_placeholders(entry.gm)):
        val = node.meta.get(KEY)
        if node in paired:
            new_index = position[paired[node]]
            frozen = entry.frozen.get(index)
            if frozen is not None and frozen() is not example_inputs[new_index]:
                log.debug("graphopt: %s is not the tensor graph %s was compiled with", node.name,
                          getattr(entry.report, "graph_index", "?"))
                return None
            if frozen is None and not _passed_at_run_time(paired[node], example_inputs[new_index]):
                return None
            plan.append(("arg", new_index))
        elif isinstance(val, torch.SymInt) and val.node.expr.is_Symbol and val.node.expr in binding:
            bound = binding[val.node.expr]
            if isinstance(bound, sympy.Integer):
                plan.append(("const", int(bound)))
            elif bound in new_sizes:
                plan.append(("arg", new_sizes[bound]))
            else:
                return None
        else:
            return None  # a float, a bool, or a size the new graph does not carry
    return plan


def _served(compiled: Callable, entry: _Compiled, plan: list[tuple[str, Any]], binding: dict,
            config: Any) -> Callable:
    earlier = entry.report
    where = f"graph {earlier.graph_index}" if earlier is not None else "an earlier graph"
    note = (f"served by {where}'s compiled code: this graph is that one with {graph_instance.describe(binding)} "
            f"(dynamo's retrace; no AOT trace, passes or build)")
    report = CompileReport(target=getattr(earlier, "target", config.target),
                           requested_target=getattr(earlier, "requested_target", config.target),
                           frontend="dynamo", op_counts=dict(getattr(earlier, "op_counts", {})), notes=[note],
                           recompile_reason=dynamo_recompile_reason())
    if report.recompile_reason:
        log.info("graphopt: dynamo recompiles a graph because a guard failed: %s", report.recompile_reason)
    record(report)
    log.info("graphopt: %s", note)

    def run_earlier(*args: Any) -> Any:  # dynamo calls a backend's callable with the graph's inputs
        return compiled(*[args[value] if kind == "arg" else value for kind, value in plan])

    return run_earlier


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _passed_at_run_time(node: fx.Node, example: Any) -> bool:
    """A top-level tensor argument of the call (``L['input_ids']``), which the compiled code
    reads on every call; a parameter, a buffer or anything reached through an attribute is
    frozen into it."""
    from torch._dynamo.source import LocalSource

    if isinstance(example, torch.nn.Parameter):
        return False
    source = getattr(node.meta.get("grapharg"), "source", None)
    return isinstance(source, LocalSource)


def _is_symbolic(val: Any) -> bool:
    if isinstance(val, torch.SymInt):
        return not val.node.is_constant()
    return isinstance(val, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in val.shape)


def dynamo_recompile_reason() -> str | None:
    """Why dynamo is compiling this frame again (``0/0: tensor 'input_ids' size mismatch at
    index 1. expected 5, actual 7``), from the compile's metrics; None on a first compile."""
    try:
        from torch._dynamo.utils import get_metrics_context

        context = get_metrics_context()
        return context._metrics.get("recompile_reason") if context.in_progress() else None  # noqa: SLF001
    except Exception:  # a private torch detail: without it the log line is all that is lost
        return None
