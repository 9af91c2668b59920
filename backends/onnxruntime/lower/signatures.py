"""Sizes of a graph with symbolic shapes, as the ONNX Runtime target needs them.

An ONNX model takes and returns tensors only; a dynamo graph with symbolic sizes also takes
SymInts (``s0``, the length it was traced with) and may return some. ``SizePlan`` says where
each comes from at run time: a SymInt input is the size of the tensor input axis that has
the same symbolic expression (read inside the model, so the model keeps one input per
tensor), and a SymInt output is its expression evaluated on the symbols' run-time values.
A SymInt input that is no input axis's size (``scalars``: the int counters transformers'
sliding-window cache keeps, ``cumulative_length``) becomes an input of the model of its
own, a 0-d int64 tensor. Where a size cannot be had either way (a SymFloat input, an output
of a symbol nothing gives), ``SizePlan.problem`` says so and the target falls back to
``PerSignature``: one static model per input signature.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from graphopt.ir import is_symbolic_size


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


@dataclass
class SizePlan:
    """Where a symbolic graph's SymInt inputs and outputs come from."""

    sizes_from: dict[int, tuple[int, int]] = field(default_factory=dict)  # input -> (tensor input, axis)
    scalars: list[int] = field(default_factory=list)  # SymInt inputs the model takes as 0-d int64 tensors
    sources: dict[Any, tuple[int, int | None]] = field(default_factory=dict)  # symbol -> (input, axis|None)
    outputs: dict[int, Any] = field(default_factory=dict)  # output position -> sympy expression
    problem: str | None = None

    @classmethod
    def of(cls, gm: fx.GraphModule) -> "SizePlan":
        plan = cls()
        axis_of: dict[Any, tuple[int, int]] = {}
        nodes = _placeholders(gm)
        for index, node in enumerate(nodes):
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                for axis, size in enumerate(val.shape):
                    if is_symbolic_size(size):
                        axis_of.setdefault(size.node.expr, (index, axis))
                        if size.node.expr.is_Symbol:
                            plan.sources.setdefault(size.node.expr, (index, axis))
        for index, node in enumerate(nodes):
            val = node.meta.get("val")
            if isinstance(val, (torch.SymFloat, torch.SymBool)):
                plan.problem = f"input {node.name} is a symbolic {type(val).__name__}, which no tensor's size gives"
            elif is_symbolic_size(val):
                expr = val.node.expr
                if expr in axis_of:
                    plan.sizes_from[index] = axis_of[expr]
                else:
                    plan.scalars.append(index)
                if expr.is_Symbol:
                    plan.sources.setdefault(expr, (index, None))
        outputs = gm.graph.output_node().args[0]
        outputs = outputs if isinstance(outputs, (tuple, list)) else [outputs]
        for position, out in enumerate(outputs):
            val = out.meta.get("val") if isinstance(out, fx.Node) else None
            if is_symbolic_size(val):
                missing = [s for s in val.node.expr.free_symbols if s not in plan.sources]
                if missing:
                    plan.problem = f"the SymInt output {out.name} = {val.node.expr} depends on no input size"
                plan.outputs[position] = val.node.expr
        return plan

    def needs_sizes(self, output_plan: Sequence[Any]) -> bool:
        return any(isinstance(p, tuple) and p[0] == "sym" for p in output_plan)

    def sizes(self, args: Sequence[Any]) -> dict:
        """Each symbol's value in this call, read from the arguments."""
        import sympy

        return {symbol: sympy.Integer(args[i] if axis is None else args[i].shape[axis])
                for symbol, (i, axis) in self.sources.items()}

    def output(self, position: int, sizes: dict) -> int:
        return int(self.outputs[position].xreplace(sizes))


def inputs_from_meta(gm: fx.GraphModule) -> list | None:
    """Example inputs built from the placeholders' fake values, each symbolic size at its hint
    (the size dynamo traced with): zeros, since the export traces and never computes."""
    try:
        from torch.fx.experimental.symbolic_shapes import optimization_hint
    except ImportError:  # torch < 2.13 names it size_hint
        from torch.fx.experimental.symbolic_shapes import size_hint as optimization_hint

    inputs = []
    for node in _placeholders(gm):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            shape = [optimization_hint(s, fallback=2) if isinstance(s, torch.SymInt) else s for s in val.shape]
            inputs.append(torch.zeros(shape, dtype=val.dtype, device=val.device))
        elif isinstance(val, torch.SymInt):
            inputs.append(optimization_hint(val, fallback=2))
        elif isinstance(val, (int, float, bool)):
            inputs.append(val)
        else:
            return None
    return inputs


def shapes_of(gm: fx.GraphModule, example_inputs: Sequence[Any] | None = None) -> tuple[list, list[str]]:
    """(shape of each tensor input, a symbolic size as its name; the dynamic size names)."""
    if example_inputs is not None:
        return [list(x.shape) for x in example_inputs if isinstance(x, torch.Tensor)], []
    shapes, names = [], []
    for node in _placeholders(gm):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        shape = [str(s.node.expr) if is_symbolic_size(s) else int(s) for s in val.shape]
        shapes.append(shape)
        names.extend(s for s in shape if isinstance(s, str) and s not in names)
    return shapes, names


class PerSignature:
    """Export and run one static model per input signature (shapes, dtypes, int values),
    keeping the ``limit`` most recently used. ``build(gm, args, report)`` makes a callable."""

    def __init__(self, gm: fx.GraphModule, build: Callable, report: Any, limit: int) -> None:
        self.gm, self.build, self.report, self.limit = gm, build, report, limit
        self.compiled: OrderedDict[tuple, Callable] = OrderedDict()

    def __call__(self, *args: Any) -> Any:
        key = tuple((tuple(a.shape), a.dtype, a.device.type) if isinstance(a, torch.Tensor) else a for a in args)
        fn = self.compiled.get(key)
        if fn is None:
            # In a worker thread: this runs inside aot_autograd's runtime wrapper, whose
            # thread-local dispatch state breaks torch.export (functional tensors leak).
            with ThreadPoolExecutor(max_workers=1) as pool:
                fn = pool.submit(lambda: self.build(specialize(self.gm, args), list(args), self.report)).result()
            self.compiled[key] = fn
            if len(self.compiled) > self.limit:
                self.compiled.popitem(last=False)
        else:
            self.compiled.move_to_end(key)
        return fn(*args)


def specialize(gm: fx.GraphModule, args: Sequence[Any]) -> fx.GraphModule:
    """``gm`` re-traced with these inputs' concrete sizes: every size is an int again, so
    the lowering and the translations choose ORT ops from static shapes (a one-token query,
    equal sequence lengths) exactly as for a static graph. Fake tensors of the concrete
    shapes (the frozen weights stay real); graphopt ops stay ops; nodes get ``meta["val"]``.
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch.no_grad():
        return make_fx(gm, tracing_mode="fake", _allow_non_fake_inputs=True)(*args)
