"""Before/Expected pass tests (TVM Relax style): run one pass on a small graph and compare
the WHOLE result with a graph built by hand, so a stray or missing node fails the test.

Both graphs are printed with graphopt's own printer (``graphopt.ir.format_graph``, what
``--print-ir-after`` shows: op, arguments, shape and dtype, the pass that made a node) with
node names replaced by ``%0, %1, ...`` in order of definition, so the comparison does not
depend on how fx or the pass named a node. Constants are compared by value as well.

    b = Expected()
    x, w = b.input((2, 8)), b.const("weight", weight)
    b.output(b.new(graphopt.rms_norm.default, x, w, 1e-6, 0.0, by="fuse_rms_norm"))
    assert_pass_result("fuse_rms_norm", before_gm, b.module(), matches=1)
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from graphopt import ir, lazy_weights
from graphopt.pass_manager import PassResult

from tests.helpers import run_pass

_NAME = re.compile(r"%([A-Za-z_][A-Za-z0-9_]*)")


def normalized(gm: fx.GraphModule) -> str:
    """``ir.format_graph(gm)`` with every node name replaced by its position (%0, %1, ...)."""
    position = {node.name: str(i) for i, node in enumerate(gm.graph.nodes)}
    return _NAME.sub(lambda m: "%" + position.get(m.group(1), m.group(1)), ir.format_graph(gm))


def _constants(gm: fx.GraphModule) -> list[tuple[str, Any]]:
    return [(n.target, ir.get_constant(n)) for n in gm.graph.nodes if n.op == "get_attr"]


def assert_same_graph(actual: fx.GraphModule, expected: fx.GraphModule) -> None:
    """The two graphs print the same, node for node, and read equal constants."""
    got, want = normalized(actual), normalized(expected)
    assert got == want, f"graph differs from the expected one\n--- got\n{got}\n--- expected\n{want}"
    for (name, a), (_, b) in zip(_constants(actual), _constants(expected)):
        if a is None or b is None or isinstance(b, FakeTensor):
            continue  # an expected lazy weight has no values to compare; shape and dtype are printed above
        a = lazy_weights.materialize(a)  # a lazy constant a pass made reads its data from its source
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"constant {name} differs"


def assert_pass_result(pass_name: str, before: fx.GraphModule, expected: fx.GraphModule, matches: int = 1,
                       **options: Any) -> PassResult:
    """Run ``pass_name`` once on ``before``; it must report ``matches`` and leave exactly ``expected``."""
    result = run_pass(pass_name, before, **options)
    assert result.stats.get("matches") == matches, (result.stats, [m.reason for m in result.near_misses])
    assert result.modified == (matches > 0)
    assert_same_graph(result.gm, expected)
    return result


class Expected:
    """An ATen graph written node by node, with fake values (so shapes and dtypes print).

    ``op`` adds a node the input graph already had, ``new`` one the pass makes (stamped with
    ``by``, as PatternPass stamps the nodes it creates); ``const`` a frozen weight, shown by
    its parameter name like the frontend's constants."""

    def __init__(self, mode: FakeTensorMode | None = None):
        self.mode = mode or FakeTensorMode()
        self.graph = fx.Graph()
        self.root = torch.nn.Module()

    def input(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32, device: str = "cpu") -> fx.Node:
        node = self.graph.placeholder(f"in{len(self.graph.nodes)}")
        with self.mode:
            node.meta["val"] = torch.empty(shape, dtype=dtype, device=device)
        return node

    def const(self, label: str, tensor: torch.Tensor, by: str | None = None) -> fx.Node:
        """A get_attr printed as ``const <label>`` reading ``tensor`` (made by pass ``by``, if given)."""
        attr = f"c{len(self.graph.nodes)}_{label}".replace(".", "_")
        self.root.register_buffer(attr, tensor.detach(), persistent=False)
        node = self.graph.get_attr(attr)
        node.meta[ir.PARAM_NAME] = label
        if isinstance(tensor, FakeTensor):  # a lazy weight: a value of this graph's own mode, same layout
            with self.mode:
                node.meta["val"] = torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype)
        else:
            node.meta["val"] = self.mode.from_tensor(tensor, static_shapes=True)
        if by is not None:
            node.meta[ir.CREATED_BY] = by
        return node

    def op(self, target: Any, *args: Any, val: Any = None, **kwargs: Any) -> fx.Node:
        node = self.graph.call_function(target, args, kwargs)
        if val is not None:
            node.meta["val"] = val
        else:
            ir.infer_val(node, self.mode)
        return node

    def new(self, target: Any, *args: Any, by: str, val: Any = None, **kwargs: Any) -> fx.Node:
        node = self.op(target, *args, val=val, **kwargs)
        node.meta[ir.CREATED_BY] = by
        return node

    def output(self, *values: Any) -> fx.GraphModule:
        self.graph.output(list(values))
        return fx.GraphModule(self.root, self.graph)
