"""graphopt's type promotion pass inserts the casts torch.onnx's inserts, from the fake values
the graph carries (``lower/type_promotion.py``)."""

from __future__ import annotations

import copy

import onnx_ir
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.onnx._internal.exporter import _fx_passes

from graphopt.backends.onnxruntime.lower import direct_export
from graphopt.backends.onnxruntime.lower.type_promotion import insert_type_promotion_nodes
from graphopt.backends.onnxruntime.runtime.session import SessionRunner, create_session


def _aten_graph(fn, *inputs, tracing_mode: str = "fake") -> fx.GraphModule:
    return make_fx(fn, tracing_mode=tracing_mode)(*inputs)


def _casts(gm: fx.GraphModule) -> list[torch.dtype]:
    return [n.kwargs["dtype"] for n in gm.graph.nodes if n.target is torch.ops.prims.convert_element_type.default]


def _both(fn, *inputs, tracing_mode: str = "fake") -> tuple[fx.GraphModule, fx.GraphModule]:
    """(``fn``'s graph through torch.onnx's pass, through graphopt's)."""
    gm = _aten_graph(fn, *inputs, tracing_mode=tracing_mode)
    theirs, ours = gm, copy.deepcopy(gm)
    _fx_passes.insert_type_promotion_nodes(theirs)
    insert_type_promotion_nodes(ours)
    return theirs, ours


def mixed(ids, x):
    # int64 * float32 and a float64 scalar tensor: both promote
    return (ids * x + torch.tensor(0.5, dtype=torch.float64).to(x.device)).sum(-1)


def test_a_mixed_dtype_op_gets_its_cast_as_torch_onnx_inserts_it():
    ids, x = torch.randint(0, 9, (2, 3)), torch.randn(2, 3)
    theirs, ours = _both(mixed, ids, x)
    assert _casts(ours) == [torch.float32, torch.float32]  # the int64 operand; the float64 scalar
    assert ours.code == theirs.code
    cast = next(n for n in ours.graph.nodes if n.target is torch.ops.prims.convert_element_type.default)
    assert cast.meta["val"].dtype == torch.float32 and cast.args[0].meta["val"].dtype == torch.int64


def test_a_symbolic_graph_gets_the_same_casts():
    ids, x = torch.randint(0, 9, (2, 3)), torch.randn(2, 3)
    theirs, ours = _both(mixed, ids, x, tracing_mode="symbolic")
    assert len(_casts(ours)) == 2 and ours.code == theirs.code


def test_skips_an_op_whose_operands_share_a_dtype():
    def same(x, y):
        return torch.relu(x + y) * 2.0

    x, y = torch.randn(2, 3), torch.randn(2, 3)
    gm = _aten_graph(same, x, y)
    before = {n.name: n.meta.get("val") for n in gm.graph.nodes}
    insert_type_promotion_nodes(gm)
    assert _casts(gm) == []
    # nothing was run again: every node keeps the fake value it came with
    assert all(n.meta["val"] is before[n.name] for n in gm.graph.nodes if n.op != "output")


def test_the_direct_translation_of_a_mixed_dtype_op_matches_eager():
    ids, x = torch.randint(0, 9, (2, 3)), torch.randn(2, 3)
    translated = direct_export.translate(_aten_graph(mixed, ids, x), [ids, x], dynamic=False, sizes_from=None,
                                         table={})
    assert "Cast" in {n.op_type for n in translated.model.graph}
    (got,) = SessionRunner(create_session(onnx_ir.to_proto(translated.model).SerializeToString()))(ids, x)
    torch.testing.assert_close(got, mixed(ids, x))
