"""An FX graph as Python source that rebuilds it node for node, and back.

Reproducers store graphs this way instead of pickling them: the file is readable and
editable (delete nodes to shrink a failing case), and loading it runs only the code in
it, which a person can read first. ``gm.code`` would be more familiar, but turning it
back into a graph means re-tracing it, and tracing does not keep the graph: it makes
one ``get_attr`` per use of a weight and renames nodes, so the pass would see a
different graph from the one that failed. Here every node keeps its name, op, target,
arguments and the graphopt metadata (creating pass, original parameter name); tensors
live next to the source in safetensors files, and ``meta["val"]`` is recomputed with
fake tensors on load.
"""

from __future__ import annotations

import importlib
import operator
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from graphopt import ir
from graphopt.errors import GraphoptError

# Node metadata worth keeping: what the debug printers and weight-rewriting passes read.
KEPT_META = (ir.CREATED_BY, ir.PARAM_NAME)

_HEADER = '''"""{title}

One line per node: v[name] = node(name, op, target, args, kwargs, meta). Edit it to shrink
a failing case; graphopt.debug.graph_source.load_graph builds the graph from build().
"""

import operator
from math import inf, nan

import torch

import graphopt.ops  # noqa: F401  (registers the graphopt:: ops the graph may call)
from graphopt.debug.graph_source import resolve  # noqa: F401  (targets outside torch.ops)


def build(node):
    v = {{}}
'''


class SourceError(GraphoptError):
    """A graph that cannot be written as source (an argument or target with no spelling)."""


def graph_to_source(gm: fx.GraphModule, title: str = "graphopt graph") -> str:
    """Python source whose ``build(node)`` recreates ``gm.graph`` (tensors not included)."""
    lines = [_HEADER.format(title=title.replace('"""', "'''")).rstrip("\n")]
    for n in gm.graph.nodes:
        meta = {k: n.meta[k] for k in KEPT_META if k in n.meta}
        call = (f"node({n.name!r}, {n.op!r}, {_target(n)}, {_arg(tuple(n.args))}, {_arg(dict(n.kwargs))}"
                + (f", {meta!r})" if meta else ")"))
        lines.append(f"    {call}" if n.op == "output" else f"    v[{n.name!r}] = {call}")
    lines.append("    return v\n")
    return "\n".join(lines)


def _target(n: fx.Node) -> str:
    t = n.target
    if n.op in ("placeholder", "get_attr", "output"):
        return repr(t)
    if n.op != "call_function":
        raise SourceError(f"node {n.name}: {n.op} nodes are not supported in graph source (ATen graphs have none)")
    if isinstance(t, torch._ops.OpOverload):
        namespace, name = t._schema.name.split("::", 1)
        return f"torch.ops.{namespace}.{name}.{t._overloadname}"
    if isinstance(t, torch._ops.OpOverloadPacket):
        return "torch.ops." + t._qualified_op_name.replace("::", ".")
    if getattr(operator, getattr(t, "__name__", ""), None) is t:
        return f"operator.{t.__name__}"
    module, qualname = getattr(t, "__module__", None), getattr(t, "__qualname__", None)
    if module and qualname and _lookup(module, qualname) is t:
        return f"resolve({module!r}, {qualname!r})"
    raise SourceError(f"node {n.name}: target {t!r} has no importable name")


def _arg(a: Any) -> str:
    if isinstance(a, fx.Node):
        return f"v[{a.name!r}]"
    if isinstance(a, tuple):
        inner = ", ".join(_arg(x) for x in a)
        return f"({inner},)" if len(a) == 1 else f"({inner})"
    if isinstance(a, list):
        return "[" + ", ".join(_arg(x) for x in a) + "]"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k!r}: {_arg(v)}" for k, v in a.items()) + "}"
    if a is None or isinstance(a, (bool, int, str, complex)):
        return repr(a)
    if isinstance(a, float):
        return repr(a)  # inf, -inf and nan spell themselves; the header imports them
    if isinstance(a, (torch.dtype, torch.layout, torch.memory_format)):
        return str(a)  # torch.float32, torch.strided, torch.contiguous_format
    if isinstance(a, torch.device):
        return f"torch.device({str(a)!r})"
    if isinstance(a, slice):
        return f"slice({_arg(a.start)}, {_arg(a.stop)}, {_arg(a.step)})"
    if a is Ellipsis:
        return "Ellipsis"
    raise SourceError(f"cannot write argument {a!r} ({type(a).__name__}) as source")


def _lookup(module: str, qualname: str) -> Any:
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return obj
    except (ImportError, AttributeError):
        return None


def resolve(module: str, qualname: str) -> Callable:
    """The function ``module.qualname`` (targets that are not torch ops or operators)."""
    found = _lookup(module, qualname)
    if found is None:
        raise SourceError(f"cannot import {module}.{qualname}, a target of this graph")
    return found


def load_graph(source: str, constants: dict[str, torch.Tensor], inputs: list[Any],
               filename: str = "<graph source>") -> fx.GraphModule:
    """Run ``source``'s ``build`` into a new graph over ``constants`` (get_attr target ->
    tensor) and fill every ``meta["val"]`` by propagating fake ``inputs`` through it."""
    namespace: dict[str, Any] = {"__name__": "graphopt_graph_source"}
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102  (the reproducer's own source)
    graph = fx.Graph()

    def node(name: str, op: str, target: Any, args: tuple = (), kwargs: dict | None = None,
             meta: dict | None = None) -> fx.Node:
        created = graph.create_node(op, target, tuple(args), dict(kwargs or {}), name=name)
        created.meta.update(meta or {})
        return created

    namespace["build"](node)
    missing = sorted(n.target for n in graph.nodes if n.op == "get_attr" and n.target not in constants)
    if missing:
        raise SourceError(f"constants missing for get_attr {', '.join(missing[:5])}; the tensors file does not match the graph")
    gm = fx.GraphModule({k: v for k, v in constants.items()}, graph)
    propagate_fake_values(gm, inputs)
    return gm


def propagate_fake_values(gm: fx.GraphModule, inputs: list[Any]) -> None:
    """Fill ``meta["val"]`` of every node with fake tensors, as the frontends do."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)  # constants stay real until first use
    FakeTensorProp(gm, mode).propagate(*inputs)
