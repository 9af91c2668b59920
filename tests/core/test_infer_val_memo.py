"""ir.infer_val gives a call it made before on one fake mode its value again: by metadata for
ops that return no view, by identity for views, never for ops that write an input."""

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from graphopt import ir

aten = torch.ops.aten


def _graph() -> tuple[fx.GraphModule, fx.Node, fx.Node]:
    gm = make_fx(lambda a, b: (a + 1, b + 1), tracing_mode="fake")(torch.randn(3, 4), torch.randn(3, 4))
    a, b = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return gm, a, b


def _call(gm: fx.GraphModule, target, *args) -> fx.Node:
    with gm.graph.inserting_before(gm.graph.output_node()):
        node = gm.graph.call_function(target, args)
    ir.infer_val(node)
    return node


def test_an_op_on_inputs_alike_gives_the_value_again():
    gm, a, b = _graph()
    first, again = _call(gm, aten.mul.Tensor, a, a), _call(gm, aten.mul.Tensor, b, b)
    assert again.meta["val"] is first.meta["val"]  # b is another tensor of a's metadata
    assert _call(gm, aten.mul.Scalar, a, 2).meta["val"] is not _call(gm, aten.mul.Scalar, a, 2.0).meta["val"]


def test_skips_a_view_of_another_tensor_and_an_op_that_writes_its_input():
    gm, a, b = _graph()
    view_a, view_b = _call(gm, aten.t.default, a), _call(gm, aten.t.default, b)
    assert view_b.meta["val"] is not view_a.meta["val"]  # a view keys its input by identity
    assert _call(gm, aten.t.default, a).meta["val"] is view_a.meta["val"]
    memo = ir._InferMemo.of(ir.fake_mode_of(gm))
    assert memo.key(aten.add_.Tensor, (a.meta["val"], b.meta["val"]), {}) is None  # it writes a


def test_a_memo_value_matches_a_fresh_one():
    gm, a, b = _graph()
    _call(gm, aten.mm.default, a, _call(gm, aten.t.default, a))
    node = _call(gm, aten.mm.default, b, _call(gm, aten.t.default, b))
    fresh = aten.mm.default(*[torch.empty_strided(x.meta["val"].shape, x.meta["val"].stride(), device="meta")
                              for x in node.args])
    val = node.meta["val"]
    assert (val.shape, val.stride(), val.dtype) == (fresh.shape, fresh.stride(), torch.float32)
