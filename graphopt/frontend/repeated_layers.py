"""Trace a stack of identical layers once: export the model with two of its N layers, then
stamp layers 2 .. N-1 into the graph as copies of layer 1 reading their own weights.

Why: torch.export's cost grows with the graph, and a decoder's graph is N copies of one
layer. Qwen2.5-0.5B's 24 layers took 20+ s to trace here, two layers 2-3 s; the copies cost
milliseconds. The result is the graph the whole trace gives, layer for layer: the same ops,
arguments and fake values, each layer's weights its own.

When it applies (``find_stack``): the model holds an ``nn.ModuleList`` of at least 3 layers
of one class whose parameters have the same names, shapes and dtypes and whose plain
attributes (ints, floats, strings, bools, None) are equal except ones equal to the layer's
index (``layer_idx``), and every per-layer list of the model's config (``layer_types``, ...)
is uniform. The model must iterate over the list as it finds it (transformers' decoders slice
``self.layers[:num_hidden_layers]``), so a list of two traces two layers.

After the trace ``stamp`` checks that layer 0's and layer 1's nodes match one for one (same
ops, arguments and constants up to the layer's own weights), and refuses with a reason
otherwise, so a layer whose code depends on its index in a way the checks above missed is
traced whole instead (the caller's choice, ``export_aten_graph`` does it). Each layer's nodes
are found by the layer module in their ``nn_module_stack``; frozen weights by their parameter
name.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch import nn

from graphopt import ir

_PLAIN = (int, float, str, bool, type(None))
MIN_LAYERS = 3


@dataclass
class Stack:
    """A model's repeated layers: where the list lives and what it holds."""

    parent: nn.Module
    attr: str
    path: str  # the list's qualified name in the traced module ("step.model.model.layers")
    layers: list[nn.Module]
    layer_type: type = field(init=False)

    def __post_init__(self) -> None:
        self.layer_type = type(self.layers[0])


def find_stack(root: nn.Module) -> tuple[Stack | None, str]:
    """The longest uniform layer list in ``root``, or (None, why there is none).

    A model with no list of ``MIN_LAYERS`` layers gets (None, ""): tracing it whole costs
    nothing worth a note, so the user hears only about stacks that could not be stamped.
    """
    candidates = []
    for name, module in root.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) >= MIN_LAYERS:
            candidates.append((name, module))
    if not candidates:
        return None, ""
    name, layers = max(candidates, key=lambda item: len(item[1]))
    problem = _uniformity_problem(list(layers)) or _config_problem(root, len(layers))
    if problem:
        return None, problem
    parent_name, _, attr = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    return Stack(parent, attr, name, list(layers)), ""


def _attributes(layer: nn.Module) -> dict[tuple[str, str], Any]:
    """The plain attributes (ints, floats, strings, bools, None) of a layer and its submodules."""
    return {(sub_name, key): value for sub_name, sub in layer.named_modules() for key, value in vars(sub).items()
            if not key.startswith("_") and isinstance(value, _PLAIN)}


def _uniformity_problem(layers: list[nn.Module]) -> str | None:
    attrs = [_attributes(layer) for layer in layers]
    # An attribute equal to its layer's index in every layer (layer_idx) is what tells the
    # cache which layer it is; the graph does not depend on it.
    index_keys = {key for key in attrs[0] if all(a.get(key) == i and type(a.get(key)) is int
                                                  for i, a in enumerate(attrs))}

    def signature(i: int) -> tuple:
        params = tuple((n, tuple(t.shape), t.dtype) for n, t in layers[i].state_dict(keep_vars=True).items())
        return type(layers[i]), params, {k: v for k, v in attrs[i].items() if k not in index_keys}

    first = signature(1)
    for i in range(len(layers)):
        if signature(i) != first:
            return f"layer {i} differs from layer 1 (class, weights or attributes)"
    return None


def _config_problem(root: nn.Module, count: int) -> str | None:
    """A per-layer config list (``layer_types``, ``no_rope_layers``, ...) whose entries differ."""
    for module in root.modules():
        config = getattr(module, "config", None)
        if config is None or not hasattr(config, "to_dict"):
            continue
        for key, value in config.to_dict().items():
            if isinstance(value, list) and len(value) == count and len({repr(v) for v in value}) > 1:
                return f"the config's per-layer {key} is not the same for every layer"
        return None
    return None


@contextlib.contextmanager
def two_layers(stack: Stack) -> Iterator[None]:
    """The model with only its first two layers for the block."""
    full = getattr(stack.parent, stack.attr)
    setattr(stack.parent, stack.attr, nn.ModuleList(stack.layers[:2]))
    try:
        yield
    finally:
        setattr(stack.parent, stack.attr, full)


class NotStampable(Exception):
    """Layer 0 and layer 1 did not trace alike; the message says where."""


def stamp(gm: fx.GraphModule, stack: Stack) -> int:
    """Add layers 2 .. N-1 to ``gm`` (traced with two), in place; returns the layers now in it.
    Raises NotStampable when the two traced layers differ."""
    owner = {0: [], 1: []}
    for node in gm.graph.nodes:
        index = _layer_of(node, stack)
        if index in owner:
            owner[index].append(node)
    first, second = owner[0], owner[1]
    if not first or len(first) != len(second):
        raise NotStampable(f"layers 0 and 1 traced to {len(first)} and {len(second)} nodes")
    iso = _match_layers(first, second, stack)
    in_first, in_second = set(first), set(second)
    readers = {n: [u for u in n.users if u not in in_first and u not in in_second] for n in second}
    outputs = next(n for n in gm.graph.nodes if n.op == "output")
    copies = [{n: n for n in second}]  # copies[j]: layer 1's nodes -> layer (j + 1)'s
    anchor = max(second, key=_order(gm))
    for i in range(2, len(stack.layers)):
        previous, made = copies[-1], {}
        for node in second:
            with gm.graph.inserting_after(anchor):
                made[node] = _copy(gm, node, i, stack, made, previous, iso, in_first)
            if made[node] is not node:  # a shared constant stays where it is
                anchor = made[node]
        copies.append(made)
    last = copies[-1]
    flat = list(outputs.args[0])
    for node in second:
        for reader in readers[node]:
            if reader is not outputs:  # what reads the stack's result (the final norm) reads the last layer's
                reader.replace_input_with(node, last[node])
    per_layer = [value for value in flat if value in in_second]  # layer 1's own outputs (its cache)
    if per_layer:
        at = max(flat.index(value) for value in per_layer) + 1
        flat[at:at] = [copy[value] for copy in copies[1:] for value in per_layer]
    outputs.args = (type(outputs.args[0])(flat),)
    gm.graph.lint()
    gm.recompile()
    return len(stack.layers)


def _order(gm: fx.GraphModule):
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    return lambda node: position[node]


def _layer_of(node: fx.Node, stack: Stack) -> int | None:
    """Which layer of the stack a node belongs to: its module stack's entry of the layer's
    class, or a frozen constant's name (a parameter, or a tensor the layer's code made)."""
    if node.op == "get_attr":
        found = re.match(rf"^{re.escape(stack.path)}\.(\d+)\.", _param(node))
        return int(found.group(1)) if found else None
    wanted = f"{stack.layer_type.__module__}.{stack.layer_type.__qualname__}"
    for path, kind in (node.meta.get("nn_module_stack") or {}).values():
        if kind is stack.layer_type or kind == wanted:
            tail = path.rsplit(".", 1)[-1]
            return int(tail) if tail.isdigit() else None
    return None


def _param(node: fx.Node) -> str:
    """A frozen constant's name without the ``slice(None, N, None)`` a sliced list adds."""
    return re.sub(r"\.slice\([^)]*\)", "", node.meta.get(ir.PARAM_NAME, ""))


def _match_layers(first: list[fx.Node], second: list[fx.Node], stack: Stack) -> dict[fx.Node, fx.Node]:
    """Layer 0's node -> layer 1's, checking the two layers are the same computation."""
    iso: dict[fx.Node, fx.Node] = {}
    in_first, in_second = set(first), set(second)
    for a, b in zip(first, second):
        if a.op != b.op or (a.op != "get_attr" and a.target != b.target):
            raise NotStampable(f"{a.name} ({a.target}) and {b.name} ({b.target}) differ")
        if a.op == "get_attr":
            _same_constant(a, b, stack)
        _same_args(a.args, b.args, iso, in_first, in_second, a)
        _same_args(a.kwargs, b.kwargs, iso, in_first, in_second, a)
        iso[a] = b
    return iso


def _same_constant(a: fx.Node, b: fx.Node, stack: Stack) -> None:
    """Both the layer's own parameter of one name, or (a tensor the layer's code made) equal values."""
    local_a, local_b = _local_name(a, stack), _local_name(b, stack)
    if _owned(stack.layers[0], local_a) or _owned(stack.layers[1], local_b):
        if local_a != local_b:
            raise NotStampable(f"weights {_param(a)} and {_param(b)} differ")
        return
    ta, tb = ir.get_constant(a), ir.get_constant(b)
    if ta is None or tb is None or ta.shape != tb.shape or ta.dtype != tb.dtype or not torch.equal(ta, tb):
        raise NotStampable(f"constants {_param(a)} and {_param(b)} differ")


def _local_name(node: fx.Node, stack: Stack) -> str:
    """``self_attn.q_proj.weight`` of ``step.model.model.layers.1.self_attn.q_proj.weight``."""
    return _param(node)[len(stack.path) + 1:].split(".", 1)[1]


def _owned(layer: nn.Module, name: str) -> bool:
    """Whether ``name`` is a parameter or buffer of ``layer``."""
    return name in dict(layer.named_parameters()) or name in dict(layer.named_buffers())


def _same_args(a: Any, b: Any, iso: dict, in_first: set, in_second: set, where: fx.Node) -> None:
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
            raise NotStampable(f"{where.name}: an argument is a node in one layer only")
        if a in in_first:
            if iso.get(a) is not b:
                raise NotStampable(f"{where.name}: layer 1 reads another value than layer 0's {a.name}")
        elif b in in_first:
            pass  # carried: layer 0 reads what comes before the stack, layer 1 what layer 0 made
        elif a is not b or b in in_second:
            raise NotStampable(f"{where.name}: layers 0 and 1 read different values from outside ({a.name}, {b.name})")
        return
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            raise NotStampable(f"{where.name}: argument lists of different lengths")
        for x, y in zip(a, b):
            _same_args(x, y, iso, in_first, in_second, where)
        return
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            raise NotStampable(f"{where.name}: different keyword arguments")
        for key in a:
            _same_args(a[key], b[key], iso, in_first, in_second, where)
        return
    if type(a) is not type(b) or str(a) != str(b):
        raise NotStampable(f"{where.name}: argument {a!r} in layer 0, {b!r} in layer 1")


def _copy(gm: fx.GraphModule, node: fx.Node, i: int, stack: Stack, made: dict, previous: dict, iso: dict,
          in_first: set) -> fx.Node:
    """Layer ``i``'s copy of layer 1's ``node``."""
    if node.op == "get_attr":
        local = _local_name(node, stack)
        if not _owned(stack.layers[i], local):
            return node  # a constant the layer's code made (equal in every layer): shared
        name = f"{stack.path}.{i}.{local}"
        tensor = dict(stack.layers[i].named_parameters()).get(local)
        tensor = tensor if tensor is not None else dict(stack.layers[i].named_buffers())[local]
        new = ir.add_constant(gm, "w_" + name.replace(".", "_"), tensor.detach())
        new.meta[ir.PARAM_NAME] = name
        return new

    def remap(arg):
        if arg in made:
            return made[arg]
        if arg in in_first:  # carried from layer 0 into layer 1: layer i reads layer i - 1's
            return previous[iso[arg]]
        return arg

    new = gm.graph.node_copy(node, remap)
    new.meta = dict(node.meta)
    stack_meta = node.meta.get("nn_module_stack")
    if stack_meta:  # provenance: say layer i, not layer 1
        new.meta["nn_module_stack"] = {key: (re.sub(r"\.1(?=\.|$)", f".{i}", path, count=1), kind)
                                       for key, (path, kind) in stack_meta.items()}
    return new
