"""Frontends: a model or a dynamo graph -> the ATen FX graph every pass sees.

- ``compile_dynamo_graph``: the ``torch.compile`` path. aot_autograd lowers dynamo's
  graph to functional ATen ops with fake tensors in ``meta["val"]``.
- ``export_aten_graph``: the ``torch.export`` path, for tools that need a whole-model
  graph (the ONNX exporter).

Both freeze weights: parameters and buffers the graph does not mutate become
``get_attr`` constants named after the parameter (``model.layers.0.mlp.up_proj.weight``),
so passes can concatenate, quantize and fold them. Freezing keeps a reference to the
user's tensors (no copy); passes that rewrite weights make new tensors.

Float attributes (an RMSNorm's ``eps``, attention's ``scaling``) are constants too. With
``dynamic=True`` dynamo makes them graph inputs (symbolic floats), and every fusion that
needs a constant would stop firing. ``compile_dynamo_graph`` asks dynamo to specialize
them instead (``specialize_float_attributes``): dynamo traces again with each value
baked in and guards on it, so a changed value recompiles; it never runs a stale
constant (``dynamic_floats.py``). Floats passed as forward arguments stay dynamic, and a
near miss they cause names them.
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch._dynamo.exc import RestartAnalysis
from torch._guards import TracingContext
from torch._subclasses.fake_tensor import unset_fake_temporarily

from graphopt import ir
from graphopt.config import Options, fall_back
from graphopt.errors import GraphoptError
from graphopt.frontend import dynamo_reuse, repeated_layers
from graphopt.frontend.dynamic_floats import (
    dynamic_float_inputs, dynamic_float_readers, name_dynamic_floats, specialize_float_attributes,
)
from graphopt.report import CompileReport, record, reports

log = logging.getLogger("graphopt")


def compile_dynamo_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], config: Options,
                         compile_fn: Callable) -> Callable:
    """The torch.compile backend body: aot_autograd to ATen, then ``compile_fn``
    (graphopt.compiler.compile_graph; ``capture_aten_graphs`` passes one that keeps the graph).
    Passed in, so the frontend does not import the compiler that traces through it."""
    from torch._functorch.aot_autograd import aot_module_simplified

    specialize_float_attributes(gm)  # raises dynamo's restart when a float attribute is still an input
    real_inputs = list(example_inputs)
    names = dynamo_input_names(gm)
    dynamic_floats = dynamic_float_inputs(gm)
    notes = []
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in real_inputs):
        notes.append("graphopt compiles for inference: outputs of this graph do not track gradients")

    def fw_compiler(fw_gm: fx.GraphModule, fw_inputs: Sequence[Any]) -> Callable:
        # aot_autograd calls us inside its FakeTensorMode; weights and checks need real tensors.
        with unset_fake_temporarily():
            return compile_aten(fw_gm)

    def compile_aten(fw_gm: fx.GraphModule) -> Callable:
        placeholders = [n for n in fw_gm.graph.nodes if n.op == "placeholder"]
        inputs, input_names, floats, static = real_inputs, names, dynamic_floats, None
        if len(placeholders) != len(real_inputs):
            inputs, input_names, floats, static = flatten_subclass_inputs(gm, real_inputs, names, dynamic_floats)
        aligned = len(placeholders) == len(inputs)
        frozen = (freeze_static_inputs(fw_gm, inputs, input_names, static) if config.freeze_weights and aligned
                  else set())
        keep = [i for i in range(len(placeholders)) if i not in frozen]
        user_inputs = [inputs[i] for i in keep] if aligned else None
        if user_inputs is not None and not all(isinstance(x, (torch.Tensor, int, float, bool)) for x in user_inputs):
            user_inputs = None  # symbolic inputs: nothing concrete to run numeric checks on
        readers = dynamic_float_readers(fw_gm, floats) if aligned else {}
        before = len(reports())
        shape_env = _shape_env()
        guards_before = len(shape_env.guards) if shape_env is not None else 0
        compiled = compile_fn(fw_gm, user_inputs, config, "dynamo", len(frozen), notes)
        added = shape_env.guards[guards_before:] if shape_env is not None else []
        for report in reports()[before:]:
            name_dynamic_floats(report, readers)
            note_added_guards(report, added)
        if not frozen:
            return compiled

        def run_without_weights(*args: Any) -> Any:
            return compiled(*[args[i] for i in keep])

        return run_without_weights

    served = dynamo_reuse.serve(gm, real_inputs, config)  # dynamo's retrace of a graph already compiled
    if served is not None:
        return served
    try:
        before = len(reports())
        with torch.no_grad():  # inference graphs: no joint forward/backward trace
            compiled = aot_module_simplified(gm, real_inputs, fw_compiler=fw_compiler)
        made = reports()[before:]
        dynamo_reuse.remember(gm, real_inputs, compiled, config, made[0] if made else None)
        return compiled
    except (GraphoptError, RestartAnalysis):
        raise  # user errors, and dynamo's own control flow (it retraces and calls us again)
    except Exception as error:
        reason = fall_back(config, error, "frontend (lowering this graph to ATen)", "running this graph eagerly")
        report = CompileReport(target="eager", requested_target=config.target, frontend="dynamo", notes=notes)
        report.add_fallback("frontend", reason)
        record(report)
        return gm.forward


def _shape_env():
    """The ShapeEnv dynamo traced this graph with (None outside dynamo, or when static)."""
    context = TracingContext.try_get()
    fake_mode = getattr(context, "fake_mode", None)
    return getattr(fake_mode, "shape_env", None)


def note_added_guards(report: CompileReport, guards: Sequence[Any]) -> None:
    """Say so when graphopt's own rewrites specialised a symbolic graph.

    A size comparison in a pass (``size != 1``) becomes a dynamo guard on the compiled graph,
    and an input that breaks it recompiles: the report names each such guard and the line that
    made it, so a surprise recompile leads back to the pass. Passes should not add any
    (they test sizes with ``statically_known_true``); tests hold them to that.
    """
    added = []
    for guard in guards:
        where = f"{guard.expr} ({guard.sloc})"
        text = f"graphopt's rewrite specialised this graph on {where}: an input that breaks it recompiles"
        if text not in report.notes:
            report.notes.append(text)
            added.append((text, where))
    # One line per graph: a pass that compares a size in every layer adds thirty guards to a
    # 30-layer decoder, and thirty identical warnings would bury everything else in the log.
    if len(added) == 1:
        log.warning("graphopt: %s", added[0][0])
    elif added:
        log.warning("graphopt: graphopt's rewrites specialised this graph on %d size relations, the first %s "
                    "(the report's notes list each): an input that breaks one recompiles", len(added), added[0][1])


@dataclass
class CapturedGraph:
    """An ATen graph exactly as the backend would optimize it, with its inputs."""

    gm: fx.GraphModule
    example_inputs: list | None
    frozen_weights: int


def capture_aten_graphs(module: Callable, inputs: Sequence[Any], config: Options | None = None) -> list[CapturedGraph]:
    """Run ``module(*inputs)`` under torch.compile and keep each frozen ATen graph instead
    of optimizing it: what ``graphopt debug`` runs the pipeline on."""
    config = config or Options()
    captured: list[CapturedGraph] = []

    def keep(fw_gm, user_inputs, config, frontend, frozen, notes):
        captured.append(CapturedGraph(ir.copy_graph_module(fw_gm), user_inputs, frozen))
        return fw_gm

    def backend(gm, example_inputs):
        return compile_dynamo_graph(gm, example_inputs, config, compile_fn=keep)

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(module, backend=backend)(*inputs)
    torch._dynamo.reset()
    return captured


def dynamo_input_names(gm: fx.GraphModule) -> list[str]:
    """Parameter-style names for dynamo's placeholders (``layers.0.mlp.up_proj.weight``)."""
    fqn = getattr(gm, "meta", {}).get("dynamo_flat_name_to_original_fqn", {})
    names = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        name = fqn.get(node.target) or fqn.get(node.name)
        names.append(name or _readable_dynamo_name(node.name))
    return names


def _readable_dynamo_name(name: str) -> str:
    """``l_self_modules_model_modules_layers_modules_0_parameters_weight_`` ->
    ``model.layers.0.weight`` (dynamo's own name map uses another spelling in torch 2.13)."""
    name = re.sub(r"^l_+(self|s|fn|model|mod)?_+", "", name, flags=re.IGNORECASE)
    name = re.sub(r"^(modules|parameters|buffers)_", "", name)
    name = re.sub(r"_(modules|parameters|buffers)_", ".", name)
    return name.strip("_")


def flatten_subclass_inputs(gm: fx.GraphModule, real_inputs: Sequence[Any], names: Sequence[str],
                            dynamic_floats: dict[int, str]) -> tuple[list, list[str], dict[int, str], set[int]]:
    """Dynamo's inputs as aot_autograd's graph takes them, when a tensor subclass among them
    (a DTensor weight from ``parallelize_module``) became several placeholders.

    aot_autograd flattens each DTensor into its local tensor and its DeviceMesh, so without
    this the placeholders no longer line up with dynamo's inputs: nothing is frozen and
    merge_qkv / fuse_gated_mlp, which concatenate constant weights, never fire on a DTensor
    model. Its own static indices cannot be used either: torch remaps them counting a DTensor
    as its plain tensors only, not the mesh placeholder, so they point at the wrong inputs.
    The static inputs come from dynamo's graph instead (``_dynamo_static_input_type``, what
    aot_autograd reads), one per dynamo input, and each flattened piece inherits its owner's
    name and static mark. Returns (inputs, names, dynamic floats, static indices).
    """
    from torch._functorch._aot_autograd.subclass_utils import unwrap_tensor_subclasses_with_indices_to_original

    flat, owner = unwrap_tensor_subclasses_with_indices_to_original(list(real_inputs))
    sources = [n for n in gm.graph.nodes if n.op == "placeholder"]
    static = {j for j, node in enumerate(sources)
              if node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")}
    return (flat, [names[j] if j < len(names) else f"input_{j}" for j in owner],
            {i: dynamic_floats[j] for i, j in enumerate(owner) if j in dynamic_floats},
            {i for i, j in enumerate(owner) if j in static})


def freeze_static_inputs(fw_gm: fx.GraphModule, real_inputs: Sequence[Any], names: Sequence[str],
                         static: set[int] | None = None) -> set[int]:
    """Turn weight placeholders into get_attr constants; return the frozen input indices.

    A placeholder is frozen when aot_autograd marks it static (parameters and buffers), or
    ``static`` names it, and the graph does not mutate it.
    """
    context = TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    if static is None:
        static = set(getattr(meta, "static_input_indices", None) or ())
    if not static:
        static = {i for i, t in enumerate(real_inputs) if isinstance(t, torch.nn.Parameter)}
    input_info = getattr(meta, "input_info", None) or []
    placeholders = [n for n in fw_gm.graph.nodes if n.op == "placeholder"]
    first_op = next(n for n in fw_gm.graph.nodes if n.op != "placeholder")
    frozen = set()
    for i in sorted(static):
        tensor = real_inputs[i]
        if not isinstance(tensor, torch.Tensor):
            continue
        info = input_info[i] if i < len(input_info) else None
        if info is not None and (info.mutates_data or info.mutates_metadata):
            continue  # a buffer the graph writes (a KV cache) must stay an input
        node = placeholders[i]
        with fw_gm.graph.inserting_before(first_op):
            const = constant_node(fw_gm, names[i] if i < len(names) else node.name, tensor)
        const.meta["val"] = node.meta.get("val", const.meta.get("val"))
        node.replace_all_uses_with(const)
        fw_gm.graph.erase_node(node)
        frozen.add(i)
    fw_gm.recompile()
    return frozen


def constant_node(gm: fx.GraphModule, param_name: str, tensor: torch.Tensor) -> fx.Node:
    """A get_attr node for a frozen weight, remembering the weight's original name."""
    node = ir.add_constant(gm, "w_" + param_name.replace(".", "_"), tensor.detach())
    node.meta[ir.PARAM_NAME] = param_name
    return node


@dataclass
class AtenProgram:
    """A whole model as one ATen graph (from torch.export), weights frozen."""

    gm: fx.GraphModule
    example_inputs: tuple
    out_spec: Any  # pytree spec of the model's outputs (of the two-layer trace when layers were stamped)
    frozen_weights: int
    notes: list[str] = field(default_factory=list)


def export_aten_graph(model: torch.nn.Module, args: tuple, kwargs: dict | None = None,
                      dynamic_shapes: Any = None, trace_repeated_once: bool = False) -> AtenProgram:
    """torch.export the model, decompose to ATen, and freeze its weights.

    ``trace_repeated_once``: a model whose layers repeat is traced with two of them and the
    rest stamped in as copies (graphopt/frontend/repeated_layers.py); ``AtenProgram.notes`` says
    whether it was, or why the whole model was traced.
    """
    stack, why = repeated_layers.find_stack(model) if trace_repeated_once else (None, "")
    if stack is not None:
        with repeated_layers.two_layers(stack):
            program = _export_and_freeze(model, args, kwargs, dynamic_shapes)
        try:
            layers = repeated_layers.stamp(program.gm, stack)
            program.notes.append(f"traced 2 of {layers} layers ({stack.layer_type.__name__}) and stamped the rest")
            return program
        except repeated_layers.NotStampable as error:
            why = str(error)
    program = _export_and_freeze(model, args, kwargs, dynamic_shapes)
    if trace_repeated_once and why:
        program.notes.append(f"traced every layer: {why}")
    return program


def _export_and_freeze(model: torch.nn.Module, args: tuple, kwargs: dict | None, dynamic_shapes: Any) -> AtenProgram:
    with torch.no_grad():
        program = torch.export.export(model, tuple(args), kwargs or {}, dynamic_shapes=dynamic_shapes, strict=False)
        with warnings.catch_warnings():
            # torch's own deep copy of a module call graph trips its pytree deprecation
            # (`isinstance(treespec, LeafSpec)`): nothing the user can act on, printed on every export.
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
            program = program.run_decompositions({})
    gm = program.graph_module
    signature = program.graph_signature
    if signature.buffers_to_mutate:
        raise GraphoptError("graphopt export does not handle models that mutate buffers yet")
    state = {**program.state_dict, **program.constants}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    first_op = next(n for n in gm.graph.nodes if n.op != "placeholder")
    user_inputs = list(signature.user_inputs)
    targets = {**signature.inputs_to_parameters, **signature.inputs_to_buffers,
               **signature.inputs_to_lifted_tensor_constants}
    frozen = 0
    for node in placeholders:
        if node.name in user_inputs or node.name not in targets:
            continue
        with gm.graph.inserting_before(first_op):
            const = constant_node(gm, targets[node.name], state[targets[node.name]])
        const.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(const)
        gm.graph.erase_node(node)
        frozen += 1
    _drop_metadata_asserts(gm)
    gm.recompile()
    flat_inputs = [a for a in torch.utils._pytree.tree_leaves((tuple(args), kwargs or {}))]
    return AtenProgram(gm, tuple(flat_inputs), program.call_spec.out_spec, frozen)


def _drop_metadata_asserts(gm: fx.GraphModule) -> None:
    """Remove export's ``_assert_tensor_metadata`` checks: they assert dtypes and devices
    the fake tensors already prove, and as extra users they would block fusions."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
