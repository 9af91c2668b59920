"""Which nodes of a graph ONNX Runtime can take, and an order that keeps each side together.

``refusal(node, table)`` is the reason torch.onnx's exporter cannot take a node, or None.
It asks the exporter's own tables, so it moves with torch: an ATen op the exporter
translates (its registry) or decomposes first (its decomposition table) is fine, anything
else is refused. The check is cheap and up front; an export that still fails naming an op
is the backstop (``partition.py`` moves that op and plans again).

``schedule(gm, eager)`` places every node: refused ones eager, the rest on ONNX Runtime,
and bookkeeping nodes (``getitem``, size arithmetic, ``get_attr``) wherever the run they are
ready in is, so they never cut a run. Among the nodes ready to run it keeps taking the
current side's and switches only when none is left, so a graph with one unexportable op
between two halves is three runs, not one per interleaving of independent nodes. A graph
with an in-place op keeps its node order: the order is what makes that write happen before
the reads of the tensor it writes.
"""

from __future__ import annotations

import functools
import heapq
import logging
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from graphopt.ops import op_name

ORT, EAGER = "onnxruntime", "eager"
_NEUTRAL = "neutral"


@functools.cache
def _exporter_tables() -> tuple | None:
    """(torch.onnx's registry, the ops it decomposes before translating), or None when this
    torch's exporter keeps them elsewhere (then only a failing export finds what it refuses)."""
    quiet = logging.getLogger("torch.onnx")  # it warns about optional torchvision ops it skips
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        from torch.onnx._internal.exporter import _decomp

        from graphopt.backends.onnxruntime.lower.direct_export import registry as exporter_registry
        from graphopt.backends.onnxruntime.lower.translations import translation_table

        # The export's own registry (built once): ours adds only graphopt ops, which refusal
        # looks up in the translation table before it asks torch.onnx.
        registry = exporter_registry(translation_table())
        decomposed = _decomp.create_onnx_friendly_decomposition_table(
            set(_decomp.get_onnx_implemented_overloads(registry)))
        return registry, frozenset(decomposed)
    except Exception:  # private to torch.onnx: a change there costs the up-front check only
        return None
    finally:
        quiet.setLevel(level)


def refusal(node: fx.Node, table: dict) -> str | None:
    """Why the ONNX export cannot take ``node`` (one line), or None."""
    if node.op != "call_function":
        return None
    target = node.target
    if target in table or target is operator.getitem:
        return None
    if op_name(target):
        return "no ONNX Runtime translation"  # decompose first; what is left here did not trace
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"the higher-order op {target.name()} has no ONNX form"
    if not isinstance(target, torch._ops.OpOverload):
        return None  # Python arithmetic on sizes: exported along with the tensors it sizes
    if target._schema.is_mutable:
        return "it writes one of its inputs in place, which an ONNX graph cannot express"
    val = node.meta.get("val")
    if any(free_unbacked_symbols(v) for v in _tensors(val)):
        return "its output's size depends on the values of its input"
    tables = _exporter_tables()
    if tables is None:
        return None
    registry, decomposed = tables
    if registry.is_registered(target) or target in decomposed or _decomposes_itself(target):
        return None
    return "torch.onnx has no translation or decomposition for it"


def _decomposes_itself(op: torch._ops.OpOverload) -> bool:
    """An op with a CompositeImplicitAutograd kernel becomes other ops when torch.export traces."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")


def _tensors(val) -> list[torch.Tensor]:
    items = val if isinstance(val, (tuple, list)) else [val]
    return [v for v in items if isinstance(v, torch.Tensor)]


@dataclass
class Plan:
    """The order to run the nodes in, and its runs: ``[(ORT | EAGER, [nodes])]``."""

    order: list[fx.Node]
    runs: list[tuple[str, list[fx.Node]]] = field(default_factory=list)

    def has(self, where: str) -> bool:
        return any(w == where for w, _ in self.runs)

    def reorder(self, gm: fx.GraphModule) -> None:
        """Put ``gm``'s nodes in this plan's order (a valid topological order of it)."""
        anchor = next((n for n in reversed(gm.graph.nodes) if n.op == "placeholder"), None)
        for node in self.order:
            if anchor is None:
                gm.graph.output_node().prepend(node)  # no placeholder: keep them all before the output
                continue
            anchor.append(node)
            anchor = node
        gm.recompile()


def schedule(gm: fx.GraphModule, eager: dict[fx.Node, str]) -> Plan:
    """Place each node (module docstring); ``eager`` holds the refused nodes."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    side = {n: EAGER if n in eager else _NEUTRAL if _is_neutral(n) else ORT for n in nodes}
    if any(mutates(n) for n in nodes):
        order = nodes
    else:
        order = _greedy_order(nodes, side)
    runs: list[tuple[str, list[fx.Node]]] = []
    current = next((side[n] for n in order if side[n] != _NEUTRAL), ORT)
    for node in order:
        where = side[node]
        if where != _NEUTRAL and where != current:
            current = where
        if node.op == "get_attr":
            continue  # split_module copies constants into each part that reads them
        if not runs or runs[-1][0] != current:
            runs.append((current, []))
        runs[-1][1].append(node)
    return Plan(order, runs)


def _is_neutral(node: fx.Node) -> bool:
    if node.op == "get_attr" or node.target is operator.getitem:
        return True
    return node.op == "call_function" and not isinstance(node.target, (torch._ops.OpOverload,
                                                                       torch._ops.HigherOrderOperator))


def mutates(node: fx.Node) -> bool:
    """Whether ``node`` calls an op that writes one of its inputs in place."""
    return isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


def _greedy_order(nodes: list[fx.Node], side: dict[fx.Node, str]) -> list[fx.Node]:
    """A topological order that stays on one side while it can (module docstring)."""
    index = {n: i for i, n in enumerate(nodes)}
    waiting = {n: sum(1 for i in n.all_input_nodes if i in index) for n in nodes}
    ready: dict[str, list[int]] = {ORT: [], EAGER: [], _NEUTRAL: []}
    for n in nodes:
        if not waiting[n]:
            heapq.heappush(ready[side[n]], index[n])
    current = next((side[n] for n in nodes if side[n] != _NEUTRAL), ORT)
    order = []
    while any(ready.values()):
        if ready[_NEUTRAL]:
            pick = ready[_NEUTRAL]
        elif ready[current]:
            pick = ready[current]
        else:
            current = EAGER if current == ORT else ORT
            pick = ready[current]
        node = nodes[heapq.heappop(pick)]
        order.append(node)
        for user in node.users:
            if user in waiting:
                waiting[user] -= 1
                if not waiting[user]:
                    heapq.heappush(ready[side[user]], index[user])
    if len(order) != len(nodes):  # a cycle cannot happen in an FX graph; keep the original if it did
        return nodes
    return order

