"""Helpers over the one IR every pass sees: an ATen-level ``torch.fx.GraphModule``
whose nodes carry fake tensors in ``meta["val"]``.
"""

from __future__ import annotations

import copy
import operator
import weakref
from collections import Counter
from typing import Any, Iterable

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils import _pytree as pytree

from graphopt.ops import op_name

# Metadata key naming the pass that created a node (shown by the debug printers).
CREATED_BY = "graphopt_pass"
# Metadata key holding the original parameter name of a frozen weight.
PARAM_NAME = "graphopt_param"
# Metadata key: a one-line note a pass leaves on a node for people (printed after the node).
NOTE = "graphopt_note"


def target_name(target: Any) -> str:
    """A short, stable name for a node target: ``graphopt.rms_norm``, ``aten.mm``, ``getitem``."""
    name = op_name(target)
    if name:
        return name
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._schema.name.split('::', 1)[1]}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.replace("::", ".")
    return getattr(target, "__name__", str(target))


def op_counts(gm: fx.GraphModule) -> dict[str, int]:
    """Histogram of the ops a graph calls (tuple ``getitem`` plumbing left out)."""
    counts = Counter(
        target_name(n.target)
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target is not operator.getitem
    )
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def is_symbolic_size(size: Any) -> bool:
    """Whether ``size`` is a SymInt whose value can change between calls. A symbol that a
    guard has pinned to a number (dynamo's ``s35`` for an int argument it later specialised
    to 1) is a constant: its expression is that number, although the node is still symbolic."""
    return isinstance(size, torch.SymInt) and not size.node.is_constant() and not size.node.expr.is_number


def node_count(gm: fx.GraphModule) -> int:
    return len(gm.graph.nodes)


def fake_mode_of(gm: fx.GraphModule):
    """The FakeTensorMode the graph's ``meta["val"]`` tensors belong to.

    Every val of a graph comes from one mode, so the first fake tensor names it (an active
    tracing context's mode still comes first, as detect_fake_mode gives it). Handing
    detect_fake_mode every val instead flattened the whole graph on each call: passes call
    this per inserted node, which took ~10 s of a 30-layer model's export."""
    for node in gm.graph.nodes:
        for leaf in pytree.tree_leaves(node.meta.get("val")):
            if isinstance(leaf, FakeTensor):
                return detect_fake_mode([leaf])
    return detect_fake_mode([])


def _val(arg: Any) -> Any:
    return fx.node.map_arg(arg, lambda n: n.meta["val"])


def infer_val(node: fx.Node, fake_mode=None) -> None:
    """Fill ``node.meta["val"]`` by running its target on its inputs' fake values.

    A call it has made before on the same inputs gives that call's value again
    (``_InferMemo``): a decoder's layers are alike (stamped copies sharing their fake values:
    graphopt/frontend/repeated_layers.py), so a pass's new node in layer 23 asks what it
    asked in layer 1, and running the fake kernel again on symbolic sizes costs ~1 ms."""
    if node.op != "call_function":
        return
    fake_mode = fake_mode or fake_mode_of(node.graph.owning_module)
    args, kwargs = _val(node.args), _val(node.kwargs)
    if fake_mode is None:
        node.meta["val"] = node.target(*args, **kwargs)
        return
    memo = _InferMemo.of(fake_mode)
    key = memo.key(node.target, args, kwargs)
    if key is not None and key in memo.vals:
        node.meta["val"] = memo.vals[key][0]
        return
    with fake_mode:
        node.meta["val"] = node.target(*args, **kwargs)
    if key is not None and not free_unbacked_symbols(node.meta["val"]):  # a fresh size each call
        memo.vals[key] = (node.meta["val"], (args, kwargs))  # the inputs stay alive: ids in the key stay theirs


class _InferMemo:
    """infer_val's calls on one fake mode: (target, its inputs' key) -> the value.

    Only calls whose value follows from their inputs: no op that writes an input, none whose
    value holds an unbacked size (each call makes a new one). An op that returns no view of
    an input keys a fake tensor input by its metadata (dtype, device, sizes and strides as
    expressions), so the same call on each layer's own weight hits; an op that may return a
    view (and ``getitem``) keys it by identity, so a value aliases only what it aliased when
    it was made. Other arguments key by type and value (``2`` and ``2.0`` differ)."""

    _by_mode: "weakref.WeakKeyDictionary[Any, _InferMemo]" = weakref.WeakKeyDictionary()

    def __init__(self) -> None:
        self.vals: dict[tuple, tuple[Any, Any]] = {}

    @classmethod
    def of(cls, fake_mode) -> "_InferMemo":
        memo = cls._by_mode.get(fake_mode)
        if memo is None:
            memo = cls._by_mode[fake_mode] = cls()
        return memo

    def key(self, target: Any, args: tuple, kwargs: dict) -> tuple | None:
        if isinstance(target, torch._ops.OpOverload):
            schema = target._schema
            if schema.is_mutable:
                return None
            by_meta = all(r.alias_info is None for r in schema.returns)
        elif target is operator.getitem:
            by_meta = False
        else:
            return None  # a Python function may read more than its arguments
        try:
            return (target, _arg_key(args, by_meta), _arg_key(tuple(sorted(kwargs.items())), by_meta))
        except TypeError:  # an argument with no stable key
            return None


def _arg_key(value: Any, by_meta: bool) -> Any:
    if isinstance(value, FakeTensor) and by_meta:
        if value.constant is not None:
            raise TypeError("a fake tensor with a known value")  # the value may flow into the result
        return ("meta", value.dtype, value.device, value.layout, value.requires_grad,
                _size_key(value.shape), _size_key(value.stride()), _size_key(value.storage_offset()))
    if isinstance(value, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("id", id(value))
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_arg_key(v, by_meta) for v in value))
    hash(value)  # TypeError for a value that cannot be a key
    return (type(value), value)


def _size_key(sizes: Any) -> Any:
    """Sizes as expressions: two SymInts of one expression are one size."""
    if isinstance(sizes, (tuple, list, torch.Size)):
        return tuple(_size_key(s) for s in sizes)
    return sizes.node._expr if isinstance(sizes, torch.SymInt) else sizes


def get_constant(node: Any) -> torch.Tensor | None:
    """The tensor behind a ``get_attr`` node, or None."""
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    value: Any = node.graph.owning_module
    for atom in node.target.split("."):
        value = getattr(value, atom, None)
    return value if isinstance(value, torch.Tensor) else None


def add_constant(gm: fx.GraphModule, base_name: str, tensor: torch.Tensor) -> fx.Node:
    """Register ``tensor`` on ``gm`` under a fresh name and return a get_attr node for it.

    Call inside a ``graph.inserting_*`` context to place the node.
    """
    name = _fresh_attr(gm, base_name)
    gm.register_buffer(name, tensor, persistent=False)
    node = gm.graph.get_attr(name)
    fake_mode = fake_mode_of(gm)
    if isinstance(tensor, FakeTensor):  # a lazy weight (graphopt/lazy_weights.py), from its own fake mode
        node.meta["val"] = tensor if fake_mode is None or tensor.fake_mode is fake_mode else _fake_like(fake_mode, tensor)
    else:
        node.meta["val"] = fake_mode.from_tensor(tensor, static_shapes=True) if fake_mode else tensor
    return node


def _fake_like(fake_mode, tensor: torch.Tensor) -> torch.Tensor:
    """A fake tensor of ``fake_mode`` with ``tensor``'s shape, strides and dtype: every value
    of one graph must come from one mode, whatever mode the constant's own tensor is from."""
    with fake_mode:
        return torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype,
                                   device=tensor.device)


def _fresh_attr(gm: fx.GraphModule, base: str) -> str:
    base = "".join(c if c.isalnum() or c == "_" else "_" for c in base) or "const"
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name


def describe_val(val: Any) -> str:
    """``f32[1, 8, 64]`` for a tensor value, the repr for anything else."""
    if isinstance(val, torch.Tensor):
        short = str(val.dtype).replace("torch.", "")
        short = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "int64": "i64", "int32": "i32",
                 "bool": "bool", "uint8": "u8", "int8": "i8", "float64": "f64"}.get(short, short)
        return f"{short}[{', '.join(str(s) for s in val.shape)}]"
    if isinstance(val, (tuple, list)):
        return "(" + ", ".join(describe_val(v) for v in val) + ")"
    return repr(val)


def _fmt_arg(arg: Any) -> str:
    if isinstance(arg, fx.Node):
        return f"%{arg.name}"
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(_fmt_arg(a) for a in arg)
        return f"[{inner}]"
    if isinstance(arg, float):
        return f"{arg:g}"
    return repr(arg)


def format_node(node: fx.Node) -> str:
    """One readable line: ``%mm = aten.mm(%view, %t)  : f32[8, 64]  <- fuse_qkv``."""
    if node.op == "placeholder":
        body = f"%{node.name} = input"
    elif node.op == "get_attr":
        label = node.meta.get(PARAM_NAME) or node.target
        body = f"%{node.name} = const {label}"
    elif node.op == "output":
        return f"return {_fmt_arg(node.args[0])}"
    else:
        args = [_fmt_arg(a) for a in node.args] + [f"{k}={_fmt_arg(v)}" for k, v in node.kwargs.items()]
        body = f"%{node.name} = {target_name(node.target)}({', '.join(args)})"
    line = f"{body}  : {describe_val(node.meta.get('val'))}"
    if CREATED_BY in node.meta:
        line += f"  <- {node.meta[CREATED_BY]}"
    if NOTE in node.meta:
        line += f"  // {node.meta[NOTE]}"
    return line


def format_graph(gm: fx.GraphModule) -> str:
    """The graph as text, one node a line, with shape, dtype and creating pass."""
    return "\n".join(format_node(n) for n in gm.graph.nodes)


try:  # torch's own lazily recompiled GraphModule (Inductor's passes use it the same way)
    from torch.fx._lazy_graph_module import _LazyGraphModule as _LAZY_GRAPH_MODULE
except ImportError:  # a private torch class: without it each copy generates its code at once
    _LAZY_GRAPH_MODULE = fx.GraphModule


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a copy of the graph that shares gm's tensors (no weight copy).

    The PassManager rewrites such a copy, so the caller's graph stays as it was (and, under
    instruments, one copy per pass). A copy costs about 20 us a node in fx's node creation,
    so make one only where a graph must survive. The copy generates its Python code when it
    is first called or its code read, not when it is made: most copies are only rewritten
    (SmolLM2's first compile made 14, 1.4-1.7 s of code generation no one ran).
    """
    graph = fx.Graph()
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    new = _LAZY_GRAPH_MODULE(gm, graph)
    new.meta.update(getattr(gm, "meta", {}))
    for node, old in zip(new.graph.nodes, gm.graph.nodes):
        node.meta = dict(old.meta)
    return new


def verify_graph(gm: fx.GraphModule) -> None:
    """Lint the graph and check every value node has ``meta["val"]``; raise on the first problem."""
    gm.graph.lint()
    for node in gm.graph.nodes:
        if node.op in ("output",):
            continue
        if "val" not in node.meta and not returns_nothing(node):
            raise ValueError(f"node {node.name} ({target_name(node.target)}) has no meta['val']")
        if node.op == "get_attr" and get_constant(node) is None and not hasattr(gm, node.target):
            raise ValueError(f"get_attr {node.name} points at missing attribute {node.target!r}")


def returns_nothing(node: fx.Node) -> bool:
    """An op whose schema returns nothing (a runtime assert): it has no value to carry."""
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and not schema.returns


def users_of(nodes: Iterable[fx.Node]) -> set[fx.Node]:
    return {u for n in nodes for u in n.users}
