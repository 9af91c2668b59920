"""Is one FX graph another with some of its symbolic sizes fixed? Proved node by node.

Dynamo never treats a size of 1 as dynamic (its 0/1 specialization): a model called with
batches 4 and 16 has one graph with a dynamic batch, and a batch of 1 makes dynamo trace it
again with the batch at 1. That graph is the dynamic one with ``s0 = 1`` substituted, and
whatever serves the dynamic graph serves it. ``instance_of(earlier, graph)`` proves the
substitution before anything relies on it:

- the tensor inputs pair up in order, with equal dtypes and ranks; each symbol of the earlier
  graph's input sizes is bound to the new graph's size at the same place (an int, or one of
  its own symbols), and every other size must then agree under that binding;
- the graphs' nodes (size arithmetic aside: it only computes sizes, which are compared as
  expressions where they are used) pair up in order with the same op, equal constants, the
  same producers, sizes that agree under the binding, and get_attr tensors that are equal;
- a size the earlier graph fixed but the new graph leaves symbolic fails: the earlier
  graph cannot serve a more general one.

``key`` is the node meta that holds each value: ``"val"`` in ATen graphs (the onnxruntime
target's session reuse, ``backends/onnxruntime/compile/reuse.py``), ``"example_value"`` in dynamo's
own graphs (``graphopt/frontend/dynamo_reuse.py``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx as fx

log = logging.getLogger("graphopt")
_SIZE_TYPES = (torch.SymInt, torch.SymBool, torch.SymFloat)


def describe(binding: dict) -> str:
    fixed = [f"{symbol} = {value}" for symbol, value in binding.items() if value != symbol]
    return ", ".join(sorted(fixed)) or "the same sizes"


# -- the comparison ---------------------------------------------------------------------------

class _Mismatch(Exception):
    pass


def _is_size(node: fx.Node, key: str = "val") -> bool:
    """A node that computes a size (a SymInt input, ``sym_size``, ``s0 * s1``), not a tensor."""
    val = node.meta.get(key)
    return isinstance(val, (*_SIZE_TYPES, int)) and not isinstance(val, bool) or (
        node.op == "placeholder" and isinstance(val, (int, float, bool)))


def _kept(gm: fx.GraphModule, key: str = "val") -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op != "placeholder" and not _is_size(n, key)]


def tensor_inputs(gm: fx.GraphModule, key: str = "val") -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get(key), torch.Tensor)]


def shape(gm: fx.GraphModule, key: str = "val") -> tuple:
    """The graph's input count and ops: equal for any two graphs ``instance_of`` can match."""
    return (len(tensor_inputs(gm, key)),
            tuple((n.op, str(n.target) if n.op != "get_attr" else "") for n in _kept(gm, key)))


def _expr(value: Any, key: str = "val") -> Any:
    """A size as a sympy expression, or None when ``value`` is not a size."""
    if isinstance(value, fx.Node):
        value = value.meta.get(key)
    if isinstance(value, _SIZE_TYPES):
        return value.node.expr
    if isinstance(value, int) and not isinstance(value, bool):
        import sympy  # here, not at import: the onnxruntime target's module (and so every warm start) imports this one

        return sympy.Integer(value)
    return None


def instance_of(earlier: fx.GraphModule, graph: fx.GraphModule, key: str = "val") -> dict | None:
    """The binding of ``earlier``'s symbols under which it computes what ``graph`` does, or None."""
    try:
        return _Matcher(earlier, graph, key).run()
    except _Mismatch as mismatch:
        log.debug("graphopt: not an instance of an earlier dynamic graph: %s", mismatch)
        return None


class _Matcher:
    def __init__(self, earlier: fx.GraphModule, graph: fx.GraphModule, key: str) -> None:
        self.earlier, self.graph, self.key = earlier, graph, key
        self.binding: dict = {}
        self.pairs: dict[fx.Node, fx.Node] = {}

    def run(self) -> dict:
        key = self.key
        if shape(self.earlier, key) != shape(self.graph, key):
            raise _Mismatch("the graphs have different ops or inputs")
        inputs = list(zip(tensor_inputs(self.earlier, key), tensor_inputs(self.graph, key)))
        for a, b in inputs:
            va, vb = a.meta[key], b.meta[key]
            if va.dtype != vb.dtype or va.dim() != vb.dim():
                raise _Mismatch(f"input {a.name}: {va.dtype}/{va.dim()}d vs {vb.dtype}/{vb.dim()}d")
            for sa, sb in zip(va.shape, vb.shape):  # bind plain symbols first
                ea, eb = _expr(sa), _expr(sb)
                if ea.is_Symbol and ea not in self.binding:
                    self.binding[ea] = eb
            self.pairs[a] = b
        for a, b in inputs:
            self._sizes(a.meta[key].shape, b.meta[key].shape, a)
        for a, b in zip(_kept(self.earlier, key), _kept(self.graph, key)):
            self._node(a, b)
        return self.binding

    def _same_size(self, ea: Any, eb: Any, where: fx.Node) -> None:
        if ea is None or eb is None:
            raise _Mismatch(f"{where.name}: a size against a non-size")
        if ea.free_symbols - self.binding.keys():
            raise _Mismatch(f"{where.name}: {ea} has a symbol no input size binds")
        import sympy

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
        va, vb = a.meta.get(self.key), b.meta.get(self.key)
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
        key = self.key
        if isinstance(a, fx.Node) and not _is_size(a, key):
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
        elif _expr(a, key) is not None and not isinstance(a, bool):
            self._same_size(_expr(a, key), _expr(b, key) if not isinstance(b, bool) else None, where)
        elif isinstance(b, fx.Node) or type(a) is not type(b) or a != b:
            raise _Mismatch(f"{where.name}: constant {a!r} vs {b!r}")


def _attr(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value
