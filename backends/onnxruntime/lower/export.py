"""Optimized FX graph -> ONNX model whose graphopt ops are ONNX Runtime's fused ops.

torch.onnx's exporter does the work: it translates ATen ops with torchlib's functions and
graphopt ops with our table (``translations/``), so there is no hand-built protobuf here.
Weights frozen by the frontend are buffers of the GraphModule and become initializers (a lazy
one reads the checkpoint only when written: ``onnx_model.py``, home of the ``OnnxModel`` this
returns). A compiled graph goes straight to the exporter's translation step
(``direct_export.py``); one that needs its trace first (an op it decomposes, an in-place op)
goes through ``torch.onnx.export``, which re-traces it with torch.export and decomposes what it
has no translation for. ``OnnxModel.route`` says which, and why.

Dynamic axes: a graph whose inputs have symbolic sizes (torch.export with dynamic_shapes,
the ``graphopt export`` path, or a dynamo graph after its automatic-dynamic recompile) keeps
those axes dynamic in the ONNX model; a graph with static shapes is exported static, which
lets ORT plan memory once. An ONNX model passes tensors only, so a non-tensor input is either
read from a tensor input's size (``sizes_from``: a dynamo graph's SymInt ``s0`` is the length
of some input axis) or baked in with its example value; a non-tensor output is a constant of
a static export, and ``("sym", i)`` in ``output_plan`` of a dynamic one (the caller computes
it from the run's input sizes).
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from typing import Any, Sequence

import torch
import torch.fx as fx

from graphopt.backends.onnxruntime.lower import direct_export, lowering
from graphopt.backends.onnxruntime.lower.onnx_model import OnnxModel, read_lazy_weights_when_written
from graphopt.backends.onnxruntime.onnx_passes import attention_layout, matmul_reshapes, onnx_cleanup
from graphopt.backends.onnxruntime.onnx_passes.runner import run_onnx_passes
from graphopt.backends.onnxruntime.errors import OnnxExportError, UnsupportedOp
from graphopt.backends.onnxruntime.lower.translations import translation_table
from graphopt.ir import is_symbolic_size


class _TensorsOnly(torch.nn.Module):
    """The graph with its non-tensor inputs fixed and its non-tensor outputs left out."""

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any],
                 sizes_from: dict[int, tuple[int, int]] | None = None) -> None:
        super().__init__()
        self.gm = gm
        self.sizes_from = dict(sizes_from or {})  # input index -> (tensor input index, axis)
        self.fixed = {i: v for i, v in enumerate(example_inputs)
                      if not isinstance(v, torch.Tensor) and i not in self.sizes_from}
        self.tensor_positions = [i for i, v in enumerate(example_inputs) if isinstance(v, torch.Tensor)]
        self.count = len(example_inputs)
        # Filled while torch.export traces forward. A plain object, not a list attribute:
        # non-strict export restores the module's own containers after tracing.
        self.record = _Record()

    def forward(self, *tensors: torch.Tensor):
        given = dict(zip(self.tensor_positions, tensors))
        args = [given[i] if i in given else self.fixed[i] if i in self.fixed
                else given[self.sizes_from[i][0]].shape[self.sizes_from[i][1]] for i in range(self.count)]
        outputs = self.gm(*args)
        flat = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
        plan, kept = [], []
        for position, value in enumerate(flat):
            if isinstance(value, torch.Tensor):
                plan.append(len(kept))
                kept.append(value)
            elif is_symbolic_size(value):
                plan.append(("sym", position))  # int() here would pin the export to this size
            else:
                plan.append(("const", int(value) if isinstance(value, torch.SymInt) else value))
        self.record.plan = plan
        self.record.dtypes = [t.dtype for t in kept]
        return tuple(kept)


class _Record:
    plan: list[Any] = []
    dtypes: list[torch.dtype] = []


def _dynamic_shapes(gm: fx.GraphModule, example_inputs: Sequence[Any],
                    axis_names: Sequence[dict[int, str] | None] | None) -> tuple | None:
    """A ``Dim`` for every input axis whose size is symbolic in the graph, else None.

    One Dim per symbol, so axes that are one size in the graph (q's and k's sequence, the
    batch of every input) stay one size in the export: an attention needs to know that
    to use GroupQueryAttention. ``axis_names`` ({axis: name} per tensor input) names them
    (``batch``, ``sequence``), which is what the ONNX model's dynamic axes are called.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    dims: dict[str, Any] = {}
    specs, tensor_index = [], 0
    for node, example in zip(placeholders, example_inputs):
        if not isinstance(example, torch.Tensor):
            continue
        val = node.meta.get("val")
        names = (axis_names[tensor_index] if axis_names and tensor_index < len(axis_names) else None) or {}
        tensor_index += 1
        spec = {}
        if isinstance(val, torch.Tensor):
            for axis, size in enumerate(val.shape):
                if is_symbolic_size(size):
                    symbol = str(size.node.expr)
                    name = names.get(axis) or (symbol if symbol.isidentifier() else f"dim_{len(dims)}")
                    spec[axis] = dims.setdefault(name, torch.export.Dim(name))
        specs.append(spec or None)
    return (tuple(specs),) if dims else None


def export_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], *, dynamic: bool = True,
                 opset: int | None = None, input_names: Sequence[str] | None = None,
                 output_names: Sequence[str] | None = None,
                 axis_names: Sequence[dict[int, str] | None] | None = None,
                 sizes_from: dict[int, tuple[int, int]] | None = None, scalars: Sequence[int] = (),
                 rewrite: bool = False, infer_types: bool = True, tidy_attention: bool = False) -> OnnxModel:
    """Export ``gm`` (an optimized ATen graph) to ONNX; raise UnsupportedOp / OnnxExportError.

    ``sizes_from`` {input index: (tensor input index, axis)}: non-tensor inputs to compute
    from a tensor input's size instead of baking in their example value. ``scalars``: SymInt
    inputs the model takes as 0-d int64 tensors after its tensor inputs (only the direct
    translation keeps them: the traced route's wrapper takes tensors only). ``rewrite=True``
    runs onnxscript's pattern rewrites (torch.onnx.export's ``optimize=True``); by default
    ``onnx_cleanup.light_cleanup`` folds constants instead: on a 30-layer model the rewrites
    took half of the ONNX export (SmolLM2-135M's file export: 20 of 24 s), for rewrites ORT's
    own session optimizer also makes. Without them the constant folding runs ONNX's type inference, so
    each value's dtype is what its node computes (``onnx_cleanup.match_output_dtypes`` casts by it:
    native_layer_norm's float32 mean), unless ``infer_types=False``: the in-place decoder's
    layout tidy-up reads the trace's axis names, which inference replaces.

    ``tidy_attention`` (with ``rewrite=False``): attention's layout round trips are removed
    (``attention_layout.tidy_attention_layout``) before the cleanup, while the values still
    carry the trace's shapes and axis names. On llama-small's dynamic graph that is 88 -> 32
    Transposes and 160 -> 113 Reshapes before ORT's optimizer; a 4x512 call went from
    1.04-1.08x to 0.96-1.0x of eager.
    """
    if tidy_attention and rewrite:
        raise ValueError("tidy_attention needs rewrite=False: the exporter's rewrites rename the axes it compares")
    table = translation_table()
    prepared, cached = lowering.prepare(gm, table)
    dynamic_shapes = _dynamic_shapes(prepared, example_inputs, axis_names) if dynamic else None
    names = [{a: d.__name__ for a, d in spec.items()} if spec else None for spec in dynamic_shapes[0]] \
        if dynamic_shapes else []
    direct, route = _translate_directly(prepared, example_inputs, dynamic=dynamic, sizes_from=sizes_from,
                                        scalars=scalars, table=table, opset=opset, rewrite=rewrite)
    if direct is not None:
        onnx_model = _finish(direct.model, direct.output_plan, direct.output_dtypes, cached, route, names=names,
                             input_names=input_names, output_names=output_names, infer_types=infer_types,
                             tidy_attention=tidy_attention, rewrite=rewrite)
        onnx_model.scalar_inputs = list(scalars)
        return onnx_model
    if scalars:
        raise OnnxExportError(f"SymInt inputs that no tensor's size gives need the direct translation, "
                              f"which this graph cannot take ({route.removeprefix('traced: ')})")
    prepared, cached = lowering.prepare(gm, table)  # the attempt rewrote its copy
    wrapper = _TensorsOnly(prepared, example_inputs, sizes_from)
    tensors = tuple(x for x in example_inputs if isinstance(x, torch.Tensor))

    def run_exporter(shapes):
        with _quiet():
            return torch.onnx.export(
                wrapper, tensors, dynamo=True, custom_translation_table=table, dynamic_shapes=shapes,
                opset_version=opset, input_names=list(input_names) if input_names else None,
                output_names=list(output_names) if output_names else None, optimize=rewrite, verbose=False,
            )

    try:
        try:
            program = run_exporter(dynamic_shapes)
        except Exception as error:
            if not dynamic_shapes or "Constraints violated" not in _chain_text(error):
                raise
            # A guard torch.export cannot prove over a named Dim's whole range: let each
            # axis be dynamic on its own (sizes the graph ties together still share a symbol).
            dynamic_shapes = (tuple({a: torch.export.Dim.DYNAMIC for a in spec} if spec else None
                                    for spec in dynamic_shapes[0]),)
            program = run_exporter(dynamic_shapes)
    except Exception as error:  # the exporter wraps everything; find what the user needs to know
        raise _explain(error) from error
    return _finish(program.model, wrapper.record.plan, wrapper.record.dtypes, cached, route, names=names,
                   infer_types=infer_types, tidy_attention=tidy_attention, rewrite=rewrite)


def _translate_directly(prepared: fx.GraphModule, example_inputs: Sequence[Any], *, dynamic: bool, sizes_from,
                        scalars: Sequence[int], table: dict, opset: int | None, rewrite: bool):
    """(the direct translation, "direct"), or (None, "traced: <why>") for torch.onnx.export."""
    try:
        with _quiet():
            direct = direct_export.translate(prepared, example_inputs, dynamic=dynamic, sizes_from=sizes_from,
                                             table=table, opset=opset, scalars=scalars)
            if rewrite:  # what torch.onnx.export's optimize=True runs
                from torch.onnx._internal._lazy_import import onnxscript_apis

                direct.model = onnxscript_apis.optimize(direct.model)
        return direct, "direct"
    except direct_export.NotDirect as reason:
        return None, f"traced: {reason}"
    except Exception as error:  # private exporter internals moved, or a graph the checks missed
        log = logging.getLogger(__name__)
        log.info("graphopt: the ONNX export re-traces this graph: the direct translation failed (%s)",
                 _first_line(error), exc_info=log.isEnabledFor(logging.DEBUG))
        return None, f"traced: the direct translation failed ({_first_line(error)})"


def _finish(model, output_plan, output_dtypes, cached: int, route: str, *, names, infer_types: bool,
            tidy_attention: bool, rewrite: bool, input_names=None, output_names=None) -> OnnxModel:
    """What both routes do after translating: names, then the ONNX passes (the layout tidy-up,
    cleanup, output dtypes), run and recorded by ``onnx_passes.runner``."""
    from torch.onnx._internal.exporter import _ir_passes

    read_lazy_weights_when_written(model)
    if input_names:  # the traced route's exporter renamed them already
        _ir_passes.rename_inputs(model, list(input_names))
    if output_names:
        _ir_passes.rename_outputs(model, list(output_names))
    tidy = [attention_layout.tidy_attention_layout_pass] if tidy_attention else []
    passes = [
        *tidy,
        matmul_reshapes.fold_flattened_matmuls_pass,
        *([onnx_cleanup.LightCleanup(infer_types)] if not rewrite else []),
        # The tidy-up again, now that constants are folded: transformers' graphs build each head
        # split's Reshape target from Shape/Concat nodes, which only the cleanup turns into the
        # constants the tidy-up reads (SmolLM2's prefill kept 7 Transposes per layer, its
        # decode step 4). The first pass matched on the trace's axis names, which the
        # cleanup's type inference renames, so each pass finds what the other cannot.
        *tidy,
        onnx_cleanup.TrimUnusedOutputs(),
        onnx_cleanup.MatchOutputDtypes(output_dtypes),
        *([onnx_cleanup.NameDynamicAxes(names)] if names else []),
    ]
    done = run_onnx_passes(model, passes)
    return OnnxModel(model, [v.name for v in model.graph.inputs], [v.name for v in model.graph.outputs],
                     list(output_plan), cached, route, passes=done)


@contextlib.contextmanager
def _quiet():
    """torch.onnx prints progress and warnings meant for its own CLI; keep our output clean."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "onnxscript", "torch.export", "torch._export")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _explain(error: BaseException) -> OnnxExportError:
    """The most specific one-line reason in the exporter's chain of wrapped errors."""
    chain, seen = [], set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(current)
        current = current.__cause__ or current.__context__
    for exc in chain:
        if isinstance(exc, OnnxExportError):
            return exc
    for exc in chain:
        text = str(exc)
        if "Error when translating node" in text and "target=" in text:
            target = text.split("target=", 1)[1].split("]", 1)[0].split(")", 1)[0]
            name = target.replace("torch.ops.", "").removesuffix(".default")
            return UnsupportedOp(name, _first_line(chain[-1]))
    return OnnxExportError(f"ONNX export failed: {_first_line(chain[-1])}")


def _chain_text(error: BaseException) -> str:
    texts, current, seen = [], error, set()
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        texts.append(str(current))
        current = current.__cause__ or current.__context__
    return "\n".join(texts)


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]
