"""``graphopt export``'s single-graph export: a model -> an optimized file, proven against eager.

Stages (each timed): the compile front half (graphopt.compiler.front_half: torch.export with
weights frozen, then the pass pipeline), the target's lowering to a file (ONNX with ORT's fused
ops: the onnxruntime target's ``exporter``, which runs no pass), an atomic save, and
validation: the saved file runs in its runtime on inputs of the example's shape and of a
second shape (so the dynamic axes are exercised) and is compared with eager PyTorch.

Nothing here prints: the caller passes ``stage``, a function returning a context manager
per stage name (the CLI shows a progress bar with it), and renders the returned
``ExportResult``.
"""

from __future__ import annotations

import os
from typing import Any, Protocol, Sequence

import torch

from graphopt.compiler import Optimized, front_half
from graphopt.config import Options
from graphopt.errors import GraphoptError
from graphopt.export.files import ExportResult, StageFn, Timer, check_destination, describe, save_atomically
from graphopt.export.validate import first_line, flatten_outputs, resample_like, validate
from graphopt.pipeline import with_int4

EXPORT_TARGET = "onnxruntime"  # the target whose exporter writes graphopt export's files


class Exporter(Protocol):
    """What a target lends ``graphopt export`` (its ``exporter``): lowering an optimized graph
    to a model file, and the runtime that checks the file. It runs no pass."""

    runtime: str  # "ONNX Runtime": named in errors

    def lower(self, optimized: Optimized, *, axis_names: Sequence[dict[int, str] | None], input_names: Sequence[str],
              output_names: Sequence[str] | None = None, opset: int | None = None) -> Any: ...

    def pass_records(self, lowered: Any) -> list: ...  # the passes the lowering itself ran (report.PassRecord)

    def pass_near_misses(self, lowered: Any) -> list: ...  # where they stopped short (report.NearMiss)

    def lower_graph(self, gm: Any, example_inputs: Sequence[Any]) -> Any: ...  # at the inputs' static shapes

    def open(self, path: str, provider: str) -> Any: ...


def exporter() -> Exporter:
    """The export target's exporter, found through the registry (TargetUnavailable, one line,
    when its packages are missing)."""
    from graphopt.targets import get_target

    return get_target(EXPORT_TARGET).exporter


def dims_for(axis_names: Sequence[dict[int, str] | None]) -> list[dict | None]:
    """torch.export specs for the named axes: ``Dim.DYNAMIC`` each.

    Not one named Dim per name: torch.export then has to prove every guard for all sizes
    in the Dim's range, and fails on ones it cannot simplify (the decode step's
    ``min(16 + 16*P, 32 + 32*P) == 16 + 16*P``). Equal sizes still come out as one symbol
    where the graph makes them equal; the names go to the ONNX model afterwards.
    """
    return [{axis: torch.export.Dim.DYNAMIC for axis in names} if names else None for names in axis_names]


def optimize_and_export(module: torch.nn.Module, args: Sequence[torch.Tensor], config: Options, timer: Timer, *,
                        axis_names: Sequence[dict[int, str] | None], input_names: Sequence[str],
                        output_names: Sequence[str] | None = None, opset: int | None = None,
                        dynamic_shapes: Any = None, to: Exporter | None = None):
    """The front half, then the exporter's lowering; returns (model, pipeline result).

    ``axis_names`` ({axis: name} per flat input) makes those axes dynamic and names them in
    the model; ``dynamic_shapes`` overrides the torch.export spec when the module's signature
    is not flat (``*past`` arguments), built from the same ``dims_for``.
    """
    to = to or exporter()

    def lower(optimized: Optimized):
        with timer("onnx export"):
            model = to.lower(optimized, axis_names=axis_names, input_names=input_names, output_names=output_names,
                             opset=opset)
        return model, optimized.result

    if dynamic_shapes is None:
        dynamic_shapes = tuple(dims_for(axis_names))
    return front_half(module, config, lower, args=args, dynamic_shapes=dynamic_shapes, trace_repeated_once=True,
                      timer=timer, trace_error=_untraceable)


def export_model(module: torch.nn.Module, example_inputs: Sequence[torch.Tensor], path: str | os.PathLike, *,
                 config: Options, opset: int | None = None, int4: bool = False, validate_model: bool = True,
                 force: bool = False, input_names: Sequence[str] | None = None,
                 output_names: Sequence[str] | None = None, axis_names: Sequence[dict[int, str] | None] | None = None,
                 stage: StageFn | None = None) -> ExportResult:
    """Export ``module`` (called as ``module(*example_inputs)``) to ``path`` and validate it.

    ``axis_names``: {axis: name} per input for its dynamic axes; by default the first two axes
    of every input are ``batch`` and ``sequence`` (token ids, attention masks).
    """
    from graphopt import ir

    destination = check_destination(path, force)
    config = with_int4(config, int4)
    to = exporter()
    timer = Timer(stage)
    names = list(input_names or [f"input_{i}" for i in range(len(example_inputs))])
    axes = list(axis_names or [{0: "batch", 1: "sequence"} if t.dim() >= 2 else {0: "batch"} for t in example_inputs])
    model, result = optimize_and_export(module, example_inputs, config, timer, axis_names=axes, input_names=names,
                                        output_names=output_names, opset=opset, to=to)
    with timer("save"):
        # Weights still in their checkpoint go to a .data file one tensor at a time; inline, the
        # protobuf would hold every one and then its serialized bytes (Qwen2.5-0.5B --int4: 1.44
        # GB peak against 3.30)
        files = save_atomically(model, destination, True if _streams(module) else None)
    exported = describe("model", model, files, ir.op_counts(result.gm))
    exported.notes = list(model.notes)
    if validate_model:
        with timer("validate"):
            input_sets = [list(example_inputs), resample_like(example_inputs)]
            exported.validation = validate(str(destination), _reference(module, result.gm), input_sets,
                                           config.provider, flatten_outputs, to)
    records = [r.to_dict() for r in [*result.records, *to.pass_records(model)]]
    return ExportResult([exported], timer.seconds, records, list(result.fallbacks))


def _reference(module: torch.nn.Module, optimized):
    """What the saved file is checked against: the module itself, or for a module whose weights
    are still in its checkpoint (lazy), the optimized graph, which reads the checkpoint's tensors
    as the file holds them (a quantized checkpoint's codes, dequantized a weight at a time by
    the ops' references) one node at a time as it runs (graphopt.lazy_graph.run): the same
    values, without a float copy of every weight."""
    from graphopt import lazy_weights

    return optimized if lazy_weights.has_lazy_weights(module) else module


def _streams(module: torch.nn.Module) -> bool:
    from graphopt import lazy_weights

    return lazy_weights.has_lazy_weights(module)


def _untraceable(error: Exception) -> GraphoptError:
    return GraphoptError(f"torch.export cannot capture this model: {first_line(error)}")
