"""An optimized ATen graph to ONNX without torch.export's two re-traces.

``torch.onnx.export`` traces whatever it is given again before translating it: torch.export
(a fake-tensor trace of the whole graph), then ``run_decompositions`` (a second one). A
graph graphopt has compiled is already functional ATen with a fake value on every node, so
for it both traces reproduce the graph they were given, at about 4 s of llama-small's 5 s
dynamic export. ``translate`` gives the graph to the exporter's translation step directly
(the same node-by-node translation, the same type promotion rules, read off the fake values
the graph carries: ``type_promotion.py``) when nothing in it needs the traces:

- every op has a translation, torch.onnx's or ours: an op the exporter would first
  decompose, or one it has never heard of, needs them;
- no op writes one of its inputs (torch.export would functionalize it);
- every value carries its fake value, and a static export has no symbolic size in it.

Otherwise it raises :class:`NotDirect` with the reason and ``export_graph`` takes the traced
path, which handles every graph. ``tests/backends/onnxruntime/test_direct_export.py`` holds the
two paths to the same ONNX graph.

Torch's exporter internals used here (``_core._exported_program_to_onnx_program``,
``_fx_passes``, ``_registration``) are private to torch.onnx; torch is pinned, and a change in
them raises inside ``translate``, which sends the graph the traced way.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from graphopt import ir

# torch.onnx.export's rule, kept so that both routes write the same model: the opset asked
# for (20 when none is), translated with torchlib's functions for it (never below 18), then
# converted to it.
TORCHLIB_OPSET = 18
DEFAULT_OPSET = 20


class NotDirect(Exception):
    """The graph needs torch.onnx's own trace; the message says why (one line)."""


def registry(table: dict[object, Callable], opset: int | None = None):
    """torch.onnx's registry with ``table``'s translations added, built once per table.

    Building it imports every torchlib function (``_from_torchlib``); torch.onnx.export builds
    a fresh one on every call.
    """
    return _registry(frozenset(table.items()), max(opset or DEFAULT_OPSET, TORCHLIB_OPSET))


@functools.lru_cache(maxsize=4)
def _registry(entries: frozenset, opset: int):
    from torch.onnx._internal.exporter import _registration

    quiet = logging.getLogger("torch.onnx")  # it warns about the optional torchvision ops it skips
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        built = _from_torchlib(opset)
    finally:
        quiet.setLevel(level)
    for target, translation in entries:
        built.register_op(target, translation, is_complex=False)
    return built


def _from_torchlib(opset: int):
    """``ONNXRegistry.from_torchlib(opset)``, the same entries in the same order, without the
    domain onnxscript's ``get_torchlib_ops`` asks of each function and torch never reads: a
    traced function answers it by parsing its source, 0.8 s for torchlib's ~1000 on Qwen2.5-0.5B."""
    from onnxscript.function_libs.torch_lib import ops  # noqa: F401  (importing registers them)
    from onnxscript.function_libs.torch_lib.registration import default_registry
    from torch.onnx._internal.exporter import _registration
    from torch.onnx._internal.exporter._torchlib import _torchlib_registry

    built = _registration.ONNXRegistry()
    built._opset_version = opset
    for meta in _torchlib_registry.get_torchlib_ops():
        built._register(meta.fx_target, meta)
    for name, overloads in default_registry.items():
        if name.startswith("internal::"):  # torchlib's helpers, no aten op
            continue
        for function, is_complex in [(f, False) for f in overloads.overloads] + [(f, True) for f in overloads.complex]:
            target = _registration._get_overload(name)
            if target is not None:
                built._register(target, _registration.OnnxDecompMeta(
                    onnx_function=function, fx_target=target, signature=None, is_custom=False, is_complex=is_complex))
    built._cleanup_registry_based_on_opset_version()
    return built


@dataclass
class Translated:
    model: Any  # onnx_ir.Model
    output_plan: list[Any]  # as OnnxModel.output_plan: an output index, ("const", v) or ("sym", i)
    output_dtypes: list[torch.dtype]


def translate(gm: fx.GraphModule, example_inputs: Sequence[Any], *, dynamic: bool,
              sizes_from: dict[int, tuple[int, int]] | None, table: dict[object, Callable],
              opset: int | None = None, scalars: Sequence[int] = ()) -> Translated:
    """``gm`` (a private copy: it is rewritten in place) as an ONNX model; NotDirect if it cannot be.

    Inputs, outputs and sizes follow ``export._TensorsOnly``: non-tensor inputs are read from
    a tensor's size (``sizes_from``) or baked in, non-tensor outputs go to the output plan.
    The inputs in ``scalars`` (SymInts no tensor's size gives) stay inputs: 0-d int64 tensors
    after the tensor inputs, in their order.
    """
    from torch.export import graph_signature as sig
    from torch.onnx._internal.exporter import _core, _fx_passes

    from graphopt.backends.onnxruntime.lower.type_promotion import insert_type_promotion_nodes

    reg = registry(table, opset)
    _check(gm, reg, dynamic)
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise NotDirect(f"{len(placeholders)} placeholders for {len(example_inputs)} example inputs")
    tensors = [n for n, x in zip(placeholders, example_inputs) if isinstance(x, torch.Tensor)]
    if not tensors:
        raise NotDirect("the graph has no tensor input")
    scalar_nodes = [placeholders[i] for i in scalars]
    if not dynamic and scalar_nodes:
        raise NotDirect("a static export takes no SymInt inputs")
    _replace_non_tensor_inputs(graph, placeholders, example_inputs, sizes_from or {}, set(scalars))
    last_input = [n for n in graph.nodes if n.op == "placeholder"][-1]
    weights, weight_specs = _weights_as_inputs(gm, last_input)
    plan, kept = _tensor_outputs(graph)

    graph.lint()
    gm.recompile()
    user_inputs = [sig.InputSpec(sig.InputKind.USER_INPUT, sig.TensorArgument(n.name), None) for n in tensors]
    user_inputs += [sig.InputSpec(sig.InputKind.USER_INPUT, sig.SymIntArgument(n.name), None) for n in scalar_nodes]
    signature = sig.ExportGraphSignature(
        user_inputs + weight_specs,
        [sig.OutputSpec(sig.OutputKind.USER_OUTPUT, sig.TensorArgument(n.name), None) for n in kept])
    with _no_new_guards(gm):
        insert_type_promotion_nodes(gm)
    gm = _fx_passes.remove_assertion_nodes(gm)
    program = _core._exported_program_to_onnx_program(_Program(gm, signature, weights), registry=reg)
    model = program.model
    for index, value in enumerate(model.graph.inputs):  # as torch.onnx.export names the tuple it was given
        value.name = f"tensors_{index}"
    from torch.onnx._internal._lazy_import import onnxscript_apis

    model = onnxscript_apis.convert_version(model, opset or DEFAULT_OPSET)
    return Translated(model, plan, [n.meta["val"].dtype for n in kept])


def _check(gm: fx.GraphModule, reg, dynamic: bool) -> None:
    """Raise NotDirect for the first node that needs torch.onnx's traces."""
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if node.op == "call_module":
            raise NotDirect(f"{node.name} calls a submodule")
        val = node.meta.get("val")
        if val is None and not ir.returns_nothing(node):
            raise NotDirect(f"{node.name} has no fake value")
        if not dynamic and _has_symbolic_size(val):
            raise NotDirect(f"{node.name} has a symbolic size in a static export")
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        target = node.target
        if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
            raise NotDirect(f"{node.name} ({target}) writes one of its inputs")
        if not reg.is_registered(target):
            raise NotDirect(f"{node.name} ({_name(target)}) has no direct translation")


def _replace_non_tensor_inputs(graph: fx.Graph, placeholders: list[fx.Node], example_inputs: Sequence[Any],
                               sizes_from: dict[int, tuple[int, int]], scalars: set[int]) -> None:
    """A size input becomes ``sym_size`` of the tensor axis it comes from; one in ``scalars``
    stays an input; any other is baked in."""
    for index, (node, example) in enumerate(zip(placeholders, example_inputs)):
        if isinstance(example, torch.Tensor) or index in scalars:
            continue
        if index in sizes_from:
            tensor, axis = sizes_from[index]
            with graph.inserting_before(_first_non_placeholder(graph)):
                size = graph.call_function(torch.ops.aten.sym_size.int, (placeholders[tensor], axis))
            size.meta["val"] = placeholders[tensor].meta["val"].shape[axis]
            node.replace_all_uses_with(size)
        else:
            if isinstance(example, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                raise NotDirect(f"input {index} is a symbolic size no tensor input gives")
            for user in list(node.users):
                user.args = fx.node.map_aggregate(user.args, lambda a: example if a is node else a)
                user.kwargs = fx.node.map_aggregate(user.kwargs, lambda a: example if a is node else a)
        graph.erase_node(node)


def _weights_as_inputs(gm: fx.GraphModule, after: fx.Node) -> tuple[dict[str, torch.Tensor], list]:
    """Each tensor a ``get_attr`` reads becomes a placeholder the exporter makes an initializer
    of, named ``gm.<attribute>`` as the traced export names it (it traces a wrapper holding gm)."""
    from torch.export import graph_signature as sig

    weights: dict[str, torch.Tensor] = {}
    specs: list = []
    replaced: dict[str, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.op != "get_attr":
            continue
        tensor = functools.reduce(getattr, node.target.split("."), gm)
        if not isinstance(tensor, torch.Tensor):
            raise NotDirect(f"{node.name} reads {node.target}, which is not a tensor")
        if node.target not in replaced:
            with gm.graph.inserting_after(after):
                placeholder = gm.graph.placeholder(f"w_{node.name}")
            placeholder.meta["val"] = node.meta["val"]
            after = replaced[node.target] = placeholder
            name = f"gm.{node.target}"
            weights[name] = tensor
            specs.append(sig.InputSpec(sig.InputKind.BUFFER, sig.TensorArgument(placeholder.name), name,
                                       persistent=True))
        node.replace_all_uses_with(replaced[node.target])
        gm.graph.erase_node(node)
    return weights, specs


def _tensor_outputs(graph: fx.Graph) -> tuple[list[Any], list[fx.Node]]:
    """Keep the tensor outputs; the plan says where each output of the graph comes from."""
    output = graph.output_node()
    flat = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    plan: list[Any] = []
    kept: list[fx.Node] = []
    for position, value in enumerate(flat):
        val = value.meta.get("val") if isinstance(value, fx.Node) else value
        if isinstance(val, torch.Tensor):
            if value in kept or value.op == "placeholder":
                # An ONNX value is a graph output once, and an input is not an output: a copy
                # is (as torch.export makes). A cache returned as it came in, for one.
                with graph.inserting_before(output):
                    value = graph.call_function(torch.ops.aten.clone.default, (value,))
                value.meta["val"] = val
            plan.append(len(kept))
            kept.append(value)
        elif ir.is_symbolic_size(val):
            plan.append(("sym", position))
        else:
            plan.append(("const", int(val) if isinstance(val, torch.SymInt) else val))
    output.args = (tuple(kept),)
    return plan, kept


class _Program:
    """What the exporter's translation step reads of an ExportedProgram, and nothing else."""

    def __init__(self, gm: fx.GraphModule, signature, weights: dict[str, torch.Tensor]) -> None:
        self.graph_module = gm
        self.graph_signature = signature
        self.constants: dict[str, torch.Tensor] = {}
        self.range_constraints: dict = {}
        self._weights = weights

    def named_parameters(self):
        return iter(())

    def named_buffers(self):
        return iter(self._weights.items())


def _no_new_guards(gm: fx.GraphModule):
    """Guards off, for this thread, on the shape environment the graph's sizes live in.

    The type promotion pass runs every node again on its fake values, and some fake kernels
    ask questions of a symbolic size (``check_contiguous_sizes_strides``: ``s0 == 1``?). Here
    that environment is dynamo's own (torch.export made a fresh one), so each question would
    become a guard of the compiled graph and a batch of 1 would compile it again. The pass
    only decides dtypes, which no size changes; the answers about strides it gets are
    discarded with the fake values ONNX has no use for.
    """
    shape_env = getattr(ir.fake_mode_of(gm), "shape_env", None)
    return shape_env.suppress_guards() if shape_env is not None else contextlib.nullcontext()


def _first_non_placeholder(graph: fx.Graph) -> fx.Node:
    return next(n for n in graph.nodes if n.op != "placeholder")


def _has_symbolic_size(val: Any) -> bool:
    values = val if isinstance(val, (tuple, list)) else (val,)
    for v in values:
        if isinstance(v, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in v.shape):
            return True
        if isinstance(v, (torch.SymInt, torch.SymFloat)):
            return True
    return False


def _name(target: Any) -> str:
    return target.name() if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))
