"""Serve a recompiled graph from an earlier dynamic graph's session, when it is an instance of it.

Dynamo never treats a size of 1 as dynamic (its 0/1 specialization). A model that has been
called with batches 4 and 16 has one graph with a dynamic batch, guarded ``2 <= batch``; a
batch of 1 then fails that guard and dynamo traces the model again, with the batch fixed at 1.
That graph is the dynamic one with ``s0 = 1`` substituted: the same ops on the same weights.
The session exported for the dynamic graph computes it already (an ONNX model has no guards,
and its dynamic axes take any size), so exporting again would only cost time (a minute on
llama-small) and a second copy of the weights in memory.

``instance_of(earlier, graph)`` proves the substitution node by node, before any reuse:

- the tensor inputs pair up in order, with equal dtypes and ranks; each symbol of the earlier
  graph's input sizes is bound to the new graph's size at the same place (an int, or one of
  its own symbols), and every other size must then agree under that binding;
- the graphs' nodes (size arithmetic aside: it only computes sizes, which are compared as
  expressions where they are used) pair up in order with the same op, equal constants, the
  same producers, sizes that agree under the binding, and get_attr tensors that are equal;
- a size the earlier graph fixed but the new graph leaves symbolic fails: the earlier
  graph cannot serve a more general one.

Anything that does not match exports as usual; a match records a note in the report, not a
build. Entries live as long as the compiled callable that owns the session.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx as fx

log = logging.getLogger("graphopt")
_SIZE_TYPES = (torch.SymInt, torch.SymBool, torch.SymFloat)


@dataclass
class Earlier:
    """A dynamic graph's export and session, kept for graphs that are instances of it."""

    gm: fx.GraphModule
    model: Any  # OnnxModel
    session: Any  # onnxruntime.InferenceSession
    provider: str  # "cpu", "cuda", ...: a graph for another provider never matches
    shape: tuple  # the ops of its nodes: a quick filter before the full comparison


_earlier: list[weakref.ref] = []


def remember(gm: fx.GraphModule, model: Any, session: Any, provider: str, owner: Any) -> None:
    """Keep ``gm``'s session for later instances, as long as ``owner`` (its callable) lives."""
    entry = Earlier(gm, model, session, provider, _shape(gm))
    owner.graphopt_reusable = entry  # the callable holds the entry; the list only a weak ref
    _earlier.append(weakref.ref(entry))


def find(gm: fx.GraphModule, provider: str) -> tuple[Earlier, dict] | None:
    """The earlier dynamic graph ``gm`` is an instance of, with the binding of its symbols."""
    _earlier[:] = [ref for ref in _earlier if ref() is not None]
    shape = _shape(gm)
    for ref in reversed(_earlier):
        entry = ref()
        if entry is not None and entry.provider == provider and entry.shape == shape:
            binding = instance_of(entry.gm, gm)
            if binding is not None:
                return entry, binding
    return None


def describe(binding: dict) -> str:
    fixed = [f"{symbol} = {value}" for symbol, value in binding.items() if value != symbol]
    return ", ".join(sorted(fixed)) or "the same sizes"


# -- the comparison ---------------------------------------------------------------------------

class _Mismatch(Exception):
    pass


def _is_size(node: fx.Node) -> bool:
    """A node that computes a size (a SymInt input, ``sym_size``, ``s0 * s1``), not a tensor."""
    val = node.meta.get("val")
    return isinstance(val, (*_SIZE_TYPES, int)) and not isinstance(val, bool) or (
        node.op == "placeholder" and isinstance(val, (int, float, bool)))


def _kept(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op != "placeholder" and not _is_size(n)]


def _tensor_inputs(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)]


def _shape(gm: fx.GraphModule) -> tuple:
    return (len(_tensor_inputs(gm)), tuple((n.op, str(n.target) if n.op != "get_attr" else "") for n in _kept(gm)))


def _expr(value: Any) -> Any:
    """A size as a sympy expression, or None when ``value`` is not a size."""
    if isinstance(value, fx.Node):
        value = value.meta.get("val")
    if isinstance(value, _SIZE_TYPES):
        return value.node.expr
    if isinstance(value, int) and not isinstance(value, bool):
        return sympy.Integer(value)
    return None


def instance_of(earlier: fx.GraphModule, graph: fx.GraphModule) -> dict | None:
    """The binding of ``earlier``'s symbols under which it computes what ``graph`` does, or None."""
    try:
        return _Matcher(earlier, graph).run()
    except _Mismatch as mismatch:
        log.debug("graphopt: not an instance of an earlier dynamic graph: %s", mismatch)
        return None


class _Matcher:
    def __init__(self, earlier: fx.GraphModule, graph: fx.GraphModule) -> None:
        self.earlier, self.graph = earlier, graph
        self.binding: dict = {}
        self.pairs: dict[fx.Node, fx.Node] = {}

    def run(self) -> dict:
        if _shape(self.earlier) != _shape(self.graph):
            raise _Mismatch("the graphs have different ops or inputs")
        inputs = list(zip(_tensor_inputs(self.earlier), _tensor_inputs(self.graph)))
        for a, b in inputs:
            va, vb = a.meta["val"], b.meta["val"]
            if va.dtype != vb.dtype or va.dim() != vb.dim():
                raise _Mismatch(f"input {a.name}: {va.dtype}/{va.dim()}d vs {vb.dtype}/{vb.dim()}d")
            for sa, sb in zip(va.shape, vb.shape):  # bind plain symbols first
                ea, eb = _expr(sa), _expr(sb)
                if ea.is_Symbol and ea not in self.binding:
                    self.binding[ea] = eb
            self.pairs[a] = b
        for a, b in inputs:
            self._sizes(a.meta["val"].shape, b.meta["val"].shape, a)
        for a, b in zip(_kept(self.earlier), _kept(self.graph)):
            self._node(a, b)
        return self.binding

    def _same_size(self, ea: Any, eb: Any, where: fx.Node) -> None:
        if ea is None or eb is None:
            raise _Mismatch(f"{where.name}: a size against a non-size")
        if ea.free_symbols - self.binding.keys():
            raise _Mismatch(f"{where.name}: {ea} has a symbol no input size binds")
        if sympy.expand(ea.xreplace(self.binding) - eb) != 0:
            raise _Mismatch(f"{where.name}: {ea} is not {eb} under {describe(self.binding)}")

    def _sizes(self, a: Any, b: Any, where: fx.Node) -> None:
        if len(a) != len(b):
            raise _Mismatch(f"{where.name}: rank {len(a)} vs {len(b)}")
        for sa, sb in zip(a, b):
            self._same_size(_expr(sa), _expr(sb), where)

    def _node(self, a: fx.Node, b: fx.Node) -> None:
        if a.op != b.op or (a.op != "get_attr" and a.target != b.target):
            raise _Mismatch(f"{a.name} ({a.target}) vs {b.name} ({b.target})")
        if a.op == "get_attr":
            self._same_tensor(a, b)
        else:
            self._args(a.args, b.args, a)
            self._args(a.kwargs, b.kwargs, a)
        va, vb = a.meta.get("val"), b.meta.get("val")
        if isinstance(va, torch.Tensor) or isinstance(vb, torch.Tensor):
            if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)) or va.dtype != vb.dtype:
                raise _Mismatch(f"{a.name}: its value's type or dtype differs")
            self._sizes(va.shape, vb.shape, a)
        self.pairs[a] = b

    def _same_tensor(self, a: fx.Node, b: fx.Node) -> None:
        ta, tb = _attr(self.earlier, a.target), _attr(self.graph, b.target)
        if ta is tb:
            return
        if not (isinstance(ta, torch.Tensor) and isinstance(tb, torch.Tensor)) or ta.dtype != tb.dtype or \
                ta.shape != tb.shape or ta.stride() != tb.stride() or not torch.equal(ta, tb):
            raise _Mismatch(f"weight {a.target} differs from {b.target}")

    def _args(self, a: Any, b: Any, where: fx.Node) -> None:
        if isinstance(a, fx.Node) and not _is_size(a):
            if self.pairs.get(a) is not b:
                raise _Mismatch(f"{where.name}: reads {a.name}, the new graph another value")
        elif isinstance(a, (list, tuple)):
            if not isinstance(b, (list, tuple)) or len(a) != len(b):
                raise _Mismatch(f"{where.name}: argument lists differ")
            for x, y in zip(a, b):
                self._args(x, y, where)
        elif isinstance(a, dict):
            if not isinstance(b, dict) or a.keys() != b.keys():
                raise _Mismatch(f"{where.name}: keyword arguments differ")
            for key in a:
                self._args(a[key], b[key], where)
        elif _expr(a) is not None and not isinstance(a, bool):
            self._same_size(_expr(a), _expr(b) if not isinstance(b, bool) else None, where)
        elif isinstance(b, fx.Node) or type(a) is not type(b) or a != b:
            raise _Mismatch(f"{where.name}: constant {a!r} vs {b!r}")


def _attr(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value
