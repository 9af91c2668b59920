"""The Before/Expected helper (tests/passes/_before_expected.py) itself: node names do not
matter; a stray node, another constant, an op another pass made or a missing stamp do."""

import pytest
import torch

from graphopt import ir
from tests.passes._before_expected import Expected, assert_same_graph, normalized

aten = torch.ops.aten
WEIGHT = torch.arange(8.0)


def graph(stray=False, weight=WEIGHT, by="p", order=False):
    b = Expected()
    x, w = b.input((2, 8)), b.const("weight", weight)
    operands = (w, x) if order else (x, w)
    y = b.new(aten.mul.Tensor, *operands, by=by) if by else b.op(aten.mul.Tensor, *operands)
    if stray:
        b.op(aten.neg.default, y)
    return b.output(b.op(aten.relu.default, y))


def test_names_do_not_matter():
    a, b = graph(), graph()
    for i, node in enumerate(a.graph.nodes):
        node.name = f"renamed_{i}"
    assert normalized(a) == normalized(b) != ir.format_graph(a)
    assert normalized(b).splitlines()[2] == "%2 = aten.mul(%0, %1)  : f32[2, 8]  <- p"
    assert_same_graph(a, b)


@pytest.mark.parametrize("other", [
    graph(stray=True), graph(weight=WEIGHT + 1), graph(weight=WEIGHT.half()), graph(by="q"), graph(by=None),
    graph(order=True),
], ids=["stray_node", "constant_value", "constant_dtype", "other_pass", "not_stamped", "operand_order"])
def test_any_difference_fails(other):
    with pytest.raises(AssertionError):
        assert_same_graph(other, graph())
