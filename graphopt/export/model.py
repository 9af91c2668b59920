"""The export pipeline behind ``graphopt export``: a model -> an optimized ``.onnx`` file, proven.

Stages (each timed): torch.export through graphopt's frontend (weights frozen), the pass
pipeline, ONNX export with ORT's fused ops, an atomic save, and validation: the saved file
runs in ONNX Runtime on inputs of the example's shape and of a second shape (so the dynamic
axes are exercised) and is compared with eager PyTorch.

Nothing here prints: the caller passes ``stage``, a function returning a context manager
per stage name (the CLI shows a progress bar with it), and renders the returned
``ExportResult``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Sequence

import torch

from graphopt.backends.onnxruntime.errors import OnnxExportError
from graphopt.backends.onnxruntime.lower.export import OnnxModel, export_graph
from graphopt.config import Options
from graphopt.errors import GraphoptError, OptionsError

StageFn = Callable[[str], ContextManager[Any]]


@dataclass
class ExportedFile:
    """One written model: where, how big, what it is made of, how it compares with eager."""

    role: str  # "model", or "prefill" / "decode" with --kv-cache
    path: str
    files: list[str]
    size_bytes: int
    op_histogram: dict[str, int]
    fused_ops: dict[str, int]
    graphopt_ops: dict[str, int]
    inputs: list[str]
    outputs: list[str]
    validation: list[dict] = field(default_factory=list)  # one {shape, max_abs_err, rel_err, top1} per input set
    int4: dict | None = None  # OnnxModel.int4_weights(): MatMulNBits count and weight bytes
    export_route: str = "traced"  # OnnxModel.route: "direct", or "traced: <why>"
    notes: list[str] = field(default_factory=list)  # how it was made (layers traced once, ...)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class ExportResult:
    files: list[ExportedFile]
    stages_s: dict[str, float]
    passes: list[dict]
    fallbacks: list[dict]
    extra: dict = field(default_factory=dict)  # e.g. the greedy-generation check of --kv-cache

    def to_dict(self) -> dict:
        return {"files": [f.to_dict() for f in self.files], "stages_s": self.stages_s, "passes": self.passes,
                "fallbacks": self.fallbacks, **self.extra}


class Timer:
    """Times named stages and runs each inside the caller's ``stage`` context."""

    def __init__(self, stage: StageFn | None) -> None:
        self.stage = stage or (lambda name: contextlib.nullcontext())
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        with self.stage(name):
            yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def check_destination(path: str | os.PathLike, force: bool) -> Path:
    """Refuse to overwrite without ``force``; the folder must exist (checked before any work)."""
    path = Path(path)
    if path.exists() and not force:
        raise GraphoptError(f"{path} exists; pass --force to overwrite it")
    if not path.parent.is_dir():
        raise GraphoptError(f"folder {path.parent} does not exist; create it first")
    return path


def pipeline_options(config: Options, int4: bool) -> Options:
    """``config`` with ``quantize_int4`` appended for --int4 (clear error when it does not exist)."""
    if not int4:
        return config
    from graphopt.pipeline import DEFAULT_PIPELINE
    from graphopt.registry import all_passes

    if "quantize_int4" not in all_passes():
        raise OptionsError("--int4 needs the quantize_int4 pass, which this graphopt version does not have yet")
    names = list(config.pipeline or DEFAULT_PIPELINE)
    if "quantize_int4" not in names:
        names.append("quantize_int4")  # after the fusions that concatenate weights (see the pass)
    return config.replace(pipeline=names)


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
                        dynamic_shapes: Any = None):
    """torch.export -> passes -> ONNX; returns (model, pipeline result).

    ``axis_names`` ({axis: name} per flat input) makes those axes dynamic and names them in
    the ONNX model; ``dynamic_shapes`` overrides the torch.export spec when the module's
    signature is not flat (``*past`` arguments), built from the same ``dims_for``.
    """
    from graphopt.compiler import run_pipeline
    from graphopt.frontend.trace import export_aten_graph

    if dynamic_shapes is None:
        dynamic_shapes = tuple(dims_for(axis_names))
    with timer("torch.export"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own pytree deprecation notices
        try:
            program = export_aten_graph(module, tuple(args), dynamic_shapes=dynamic_shapes, trace_repeated_once=True)
        except GraphoptError:
            raise
        except Exception as error:
            raise OnnxExportError(f"torch.export cannot capture this model: {_first_line(error)}") from error
    with timer("passes"):
        result, _ = run_pipeline(program.gm, config, program.example_inputs)
    with timer("onnx export"):
        # No onnxscript pattern rewrites, as for the sessions graphopt builds itself: on SmolLM2-135M
        # they took 20 of the export's 24 s, and every runtime's loader optimizes the graph
        # anyway. The attention layout tidy-up and constant folding leave fewer nodes than they
        # did (513 against 1816), with the same outputs.
        model = export_graph(result.gm, program.example_inputs, opset=opset, input_names=input_names,
                             output_names=output_names, axis_names=axis_names, tidy_attention=True)
    model.notes = list(program.notes)
    return model, result


def save_atomically(model: OnnxModel, path: Path) -> list[str]:
    """Write into a temporary folder beside ``path``, then move into place (weights first, the
    model file last): an interrupted export leaves no half-written model."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        written = [Path(f) for f in model.save(tmp / path.name)]
        final = []
        for f in sorted(written, key=lambda p: p.name == path.name):  # the .onnx file last
            os.replace(f, path.parent / f.name)
            final.append(str(path.parent / f.name))
        stale = path.parent / (path.name + ".data")
        if not model.is_large() and stale.exists():
            stale.unlink()  # weights of an earlier, larger export under this name
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resample_like(inputs: Sequence[Any], grow: tuple[int, ...] = (1, 3), seed: int = 1) -> list[Any]:
    """Inputs of another shape for validation: the first axes grown by ``grow``, integer
    values drawn from the range the originals use (token ids stay in the vocabulary, an
    all-ones mask stays ones), floats from a normal distribution."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for x in inputs:
        if not isinstance(x, torch.Tensor):
            out.append(x)
            continue
        shape = [s + (grow[i] if i < len(grow) else 0) for i, s in enumerate(x.shape)]
        if x.dtype.is_floating_point:
            out.append(torch.randn(shape, generator=gen, dtype=x.dtype))
        elif x.dtype == torch.bool:
            out.append(torch.ones(shape, dtype=torch.bool))
        else:
            low, high = int(x.min()), int(x.max())
            out.append(torch.randint(low, high + 1, shape, generator=gen, dtype=x.dtype))
    return out


def validate(path: str, module: torch.nn.Module, input_sets: Sequence[Sequence[torch.Tensor]], provider: str,
             flatten: Callable[[Any], list[torch.Tensor]]) -> list[dict]:
    """Run the saved file in ORT on each input set and compare with eager."""
    from graphopt.backends.onnxruntime.runtime.session import SessionRunner, create_session
    from graphopt.numerics import compare

    rows = []
    try:
        runner = SessionRunner(create_session(path, provider))
    except GraphoptError:
        raise
    except Exception as error:  # ORT's own errors: one line, and where the file is
        raise OnnxExportError(f"ONNX Runtime cannot load {path}: {_first_line(error)}") from error
    for inputs in input_sets:
        with torch.no_grad():
            expected = flatten(module(*inputs))
        try:
            actual = runner(*inputs)
        except Exception as error:
            shapes = [list(t.shape) for t in inputs]
            raise OnnxExportError(f"{path} fails in ONNX Runtime on inputs {shapes}: {_first_line(error)}") from error
        diff = compare(actual, expected)
        rows.append({"input_shapes": [list(t.shape) for t in inputs], "max_abs_err": diff.max_abs, "rel_err": diff.rel,
                     "top1_agreement": top1_agreement(actual[0], expected[0])})
    return rows


def top1_agreement(actual: torch.Tensor, expected: torch.Tensor) -> float | None:
    """graphopt.quant.report.top1_agreement for an output that has a vocabulary-like last axis (a
    float tensor of rank >= 2); None for any other output."""
    from graphopt.quant.report import top1_agreement as agreement

    if not expected.is_floating_point() or expected.dim() < 2 or expected.shape[-1] < 2:
        return None
    return agreement(actual, expected)


def describe(role: str, model: OnnxModel, files: list[str], graphopt_ops: dict[str, int]) -> ExportedFile:
    return ExportedFile(role=role, path=files[-1], files=files, size_bytes=sum(os.path.getsize(f) for f in files),
                        op_histogram=model.op_histogram(), fused_ops=model.fused_op_counts(),
                        graphopt_ops={k: v for k, v in graphopt_ops.items() if k.startswith("graphopt.")},
                        inputs=model.input_names, outputs=model.output_names, int4=model.int4_weights(),
                        export_route=model.route)


def flatten_outputs(outputs: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor)]


def export_model(module: torch.nn.Module, example_inputs: Sequence[torch.Tensor], path: str | os.PathLike, *,
                 config: Options, opset: int | None = None, int4: bool = False, validate_model: bool = True,
                 force: bool = False, input_names: Sequence[str] | None = None,
                 output_names: Sequence[str] | None = None, axis_names: Sequence[dict[int, str] | None] | None = None, stage: StageFn | None = None) -> ExportResult:
    """Export ``module`` (called as ``module(*example_inputs)``) to ``path`` and validate it.

    ``axis_names``: {axis: name} per input for its dynamic axes; by default the first two axes
    of every input are ``batch`` and ``sequence`` (token ids, attention masks).
    """
    from graphopt import ir

    destination = check_destination(path, force)
    config = pipeline_options(config, int4)
    timer = Timer(stage)
    names = list(input_names or [f"input_{i}" for i in range(len(example_inputs))])
    axes = list(axis_names or [{0: "batch", 1: "sequence"} if t.dim() >= 2 else {0: "batch"} for t in example_inputs])
    model, result = optimize_and_export(module, example_inputs, config, timer, axis_names=axes, input_names=names,
                                        output_names=output_names, opset=opset)
    with timer("save"):
        files = save_atomically(model, destination)
    exported = describe("model", model, files, ir.op_counts(result.gm))
    exported.notes = list(model.notes)
    if validate_model:
        with timer("validate"):
            input_sets = [list(example_inputs), resample_like(example_inputs)]
            exported.validation = validate(str(destination), _reference(module, result.gm), input_sets,
                                           config.provider, flatten_outputs)
    return ExportResult([exported], timer.seconds, [r.to_dict() for r in result.records], list(result.fallbacks))


def _reference(module: torch.nn.Module, optimized):
    """What the saved file is checked against: the module itself, or for a module whose weights
    are still in its checkpoint (lazy), the optimized graph with the checkpoint's tensors read in
    as the file holds them (a quantized checkpoint's codes, dequantized a weight at a time by
    the ops' references): the same values, without a float copy of every weight."""
    from graphopt import lazy_weights

    if not lazy_weights.has_lazy_weights(module):
        return module
    lazy_weights.load_constants(optimized)
    return optimized


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]
