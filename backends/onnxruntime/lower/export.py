"""Optimized FX graph -> ONNX model whose graphopt ops are ONNX Runtime's fused ops.

torch.onnx's exporter does the work: it translates ATen ops with torchlib's functions and
graphopt ops with our table (``translations/``), so there is no hand-built protobuf here.
Weights frozen by the frontend are buffers of the GraphModule and become initializers. A
compiled graph goes straight to the exporter's translation step (``direct_export.py``); one
that needs its trace first (an op it decomposes, an in-place op) goes through
``torch.onnx.export``, which re-traces it with torch.export and decomposes what it has no
translation for. ``OnnxModel.route`` says which, and why.

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
import functools
import io
import logging
import os
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.fx as fx

from graphopt.backends.onnxruntime.lower import direct_export, lowering, schemas
from graphopt.backends.onnxruntime.onnx_passes import attention_layout, matmul_reshapes, onnx_cleanup
from graphopt.backends.onnxruntime.onnx_passes.runner import OnnxPassRun, run_onnx_passes
from graphopt.backends.onnxruntime.errors import OnnxExportError, UnsupportedOp
from graphopt.backends.onnxruntime.lower.translations import translation_table
from graphopt.ir import is_symbolic_size

# Protobuf cannot serialize more than 2 GiB in one message: larger models keep weights outside.
LARGE_MODEL_BYTES = 2**31 - 2**26
# Threads writing a model's external data: two keep a core reading weights while one writes.
WRITERS = min(4, os.cpu_count() or 1)
# The ORT ops a translation emits, as op_histogram spells them: one list, in schemas.py.
ORT_FUSED_OPS = schemas.FUSED_OP_NAMES


@dataclass
class OnnxModel:
    """An exported model (``onnx_ir.Model``) and what the caller needs to run it."""

    model: Any  # onnx_ir.Model
    input_names: list[str]
    output_names: list[str]
    # Position of each output of the graph: an ONNX output index, ("const", value), or
    # ("sym", i) for a symbolic size the caller computes from the inputs' sizes at run time.
    output_plan: list[Any] = field(default_factory=list)
    cached_attention: int = 0  # attentions lowered to GroupQueryAttention with past/present
    # "direct" (translated as compiled: direct_export.py) or "traced: <why>" (torch.onnx.export).
    route: str = "traced"
    # Graph inputs (placeholder positions) the model takes after its tensors, as 0-d int64
    # tensors: SymInts that no tensor input's size gives (``signatures.SizePlan.scalars``).
    scalar_inputs: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # how it was made (the frontend's layer stamping, ...)
    # The ONNX-level passes run on it: their report records and near misses (onnx_passes/runner.py).
    passes: OnnxPassRun = field(default_factory=OnnxPassRun)

    def op_histogram(self) -> dict[str, int]:
        """``{"com.microsoft::GroupQueryAttention": 8, "MatMul": 57, ...}`` over the main graph."""
        counts = Counter(f"{n.domain}::{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type
                         for n in self.model.graph)
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    def fused_op_counts(self) -> dict[str, int]:
        return {k: v for k, v in self.op_histogram().items() if k in ORT_FUSED_OPS}

    def initializer_bytes(self) -> int:
        return sum(v.const_value.nbytes for v in self.model.graph.initializers.values() if v.const_value is not None)

    def int4_weights(self) -> dict | None:
        """What MatMulNBits / GatherBlockQuantized made of the weights (None when there are
        none): ``{"matmulnbits", "embeddings", "bytes", "fp32_bytes", "ratio", "float_matmuls"}``.
        ``bytes`` is what ONNX Runtime reads of their initializers, in the dtype each op reads
        (``graphopt.quant.report.onnx_quantized_bytes``: fp16 scales behind a Cast are read as fp32),
        a tied table's codes once; ``fp32_bytes`` the same weights in fp32 (a table padded to
        whole blocks, and not again when it is the head's); ``float_matmuls`` the MatMul /
        Gemm nodes still reading a constant weight."""
        import onnx_ir as ir

        from graphopt.quant.report import constant_behind, onnx_quantized_bytes

        nodes = list(ir.traversal.RecursiveGraphIterator(self.model.graph))  # an If's branches too (int4.py)
        quantized = [n for n in nodes if n.op_type == "MatMulNBits"]
        tables = [n for n in nodes if n.op_type == "GatherBlockQuantized"]
        if not quantized and not tables:
            return None
        fp32_bytes = sum(n.attributes["K"].value * n.attributes["N"].value * 4 for n in quantized)
        heads = {constant_behind(n.inputs[1]).name for n in quantized}
        for node in tables:
            codes = constant_behind(node.inputs[0])
            if codes.name not in heads:  # a tied table's fp32 weight is the head's, counted above
                bits = node.attributes["bits"].value if "bits" in node.attributes else 4
                fp32_bytes += codes.const_value.size * 8 // bits * 4
        stored = onnx_quantized_bytes(self.model)["bytes"]
        float_matmuls = sum(1 for n in nodes if n.op_type in ("MatMul", "Gemm") and len(n.inputs) > 1
                            and constant_behind(n.inputs[1]) is not None)
        return {"matmulnbits": len(quantized), "embeddings": len(tables), "bytes": stored,
                "fp32_bytes": fp32_bytes, "ratio": stored / fp32_bytes, "float_matmuls": float_matmuls}

    def is_large(self) -> bool:
        return self.initializer_bytes() > LARGE_MODEL_BYTES

    def to_proto(self):
        import onnx_ir as ir

        return ir.serde.serialize_model(self.model)

    def to_bytes(self) -> bytes:
        if self.is_large():
            raise OnnxExportError("model is over 2 GB; save it with external data and load it from the file")
        return self.to_proto().SerializeToString()

    def save(self, path: str | os.PathLike, external_data: bool | None = None) -> list[str]:
        """Write the model; returns the files. The weights go to ``<name>.data`` beside it when
        ``external_data`` is true, or (None) when they are over 2 GB, protobuf's limit. Writing
        them outside the protobuf is also several times faster: onnx_ir writes each tensor's
        bytes as they lie, where an inline model is serialized into one message first (SmolLM2-135M's
        fp32 decoder: about 9 s inline, 3.6 s outside). Outside, tensors are written on
        ``WRITERS`` threads, each at its own offset (the same bytes as one writer): a lazy
        weight is read and re-laid out (numpy, no GIL) while another is written."""
        import onnx_ir as ir

        path = os.fspath(path)
        if external_data or (external_data is None and self.is_large()):
            data = os.path.basename(path) + ".data"
            ir.save(self.model, path, external_data=data, max_workers=WRITERS)
            return [path, os.path.join(os.path.dirname(path), data)]
        ir.save(self.model, path)
        return [path]


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


def read_lazy_weights_when_written(model) -> int:
    """Give every initializer made from a lazy weight (graphopt/lazy_weights.py: a fake tensor
    whose bytes stay in the checkpoint) a tensor that reads them when asked: when the model is
    saved, one initializer at a time, or when a fold needs a small one. Returns how many."""
    import onnx_ir as ir

    from graphopt import lazy_weights

    count = 0
    sources = {}
    for name, value in model.graph.initializers.items():
        raw = getattr(value.const_value, "raw", None)
        if not lazy_weights.is_lazy(raw):
            continue
        source = lazy_weights.source_of(raw)
        if source is None:
            raise OnnxExportError(f"weight {name} has no data: a pass made it from lazy weights without "
                                  "graphopt.lazy_weights.derive")
        value.const_value = ir.LazyTensor(functools.partial(_read_source, source, tuple(raw.shape)),
                                          dtype=value.const_value.dtype, shape=ir.Shape(tuple(raw.shape)), name=name)
        sources[name] = source
        count += 1
    _transpose_when_written(model, sources)
    return count


def _transpose_when_written(model, sources: dict) -> int:
    """``Transpose(W)`` of a lazily read weight (a linear's ``W^T``) becomes an initializer read
    transposed when written: the cleanup's constant folding would otherwise compute every
    weight's transpose at once and hold them all (a float checkpoint's whole model in memory)."""
    import onnx_ir as ir

    done = 0
    for node in list(model.graph):
        weight = node.inputs[0] if node.op_type == "Transpose" and node.domain in ("", "ai.onnx") else None
        if weight is None or weight.name not in sources or node.outputs[0].is_graph_output():
            continue
        tensor = weight.const_value
        perm = node.attributes.get("perm")
        perm = tuple(perm.as_ints()) if perm is not None else tuple(reversed(range(len(tensor.shape))))
        shape = tuple(tensor.shape[i] for i in perm)
        name = f"{weight.name}_transposed"
        read = functools.partial(_read_permuted, sources[weight.name], perm, shape)
        value = ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(tensor.dtype),
                         const_value=ir.LazyTensor(read, dtype=tensor.dtype, shape=ir.Shape(shape), name=name))
        model.graph.register_initializer(value)
        ir.convenience.replace_all_uses_with(node.outputs[0], value)
        model.graph.remove(node, safe=True)
        if not weight.uses():
            model.graph.initializers.pop(weight.name)
        done += 1
    return done


def _read_permuted(source, perm: tuple[int, ...], shape: tuple[int, ...]):
    import onnx_ir as ir

    tensor = source.load().permute(perm).contiguous()
    if tuple(tensor.shape) != shape:
        raise OnnxExportError(f"a lazy weight read as {tuple(tensor.shape)}, declared {shape}")
    return ir.Tensor(tensor.numpy())


@contextlib.contextmanager
def lazy_weights_as_stubs(model):
    """``model`` (onnx_ir) with each lazily read initializer standing as an external-data
    reference to no file, for code that serializes the graph without needing the weights
    (a subgraph extracted from it): serializing would read every one of them."""
    import onnx_ir as ir

    swapped = {}
    for name, value in model.graph.initializers.items():
        tensor = value.const_value
        if isinstance(tensor, ir.LazyTensor):
            swapped[name] = tensor
            value.const_value = ir.ExternalTensor("graphopt-lazy-weight", 0, tensor.nbytes, tensor.dtype,
                                                  shape=tensor.shape, name=name)
    try:
        yield model
    finally:
        for name, tensor in swapped.items():
            model.graph.initializers[name].const_value = tensor


def _read_source(source, shape: tuple[int, ...]):
    import onnx_ir as ir

    tensor = source.load()
    if tuple(tensor.shape) != shape:
        raise OnnxExportError(f"a lazy weight read as {tuple(tensor.shape)}, declared {shape}")
    return ir.Tensor(tensor.contiguous().numpy())


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
