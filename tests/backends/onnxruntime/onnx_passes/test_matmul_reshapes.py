"""matmul_reshapes.fold_flattened_matmuls: a projection's flatten -> MatMul -> unflatten becomes
one MatMul on the rank-3 activation, only where the Reshapes provably restore the leading axes."""

from collections import Counter

import numpy as np
import pytest
import torch

from tests.backends.onnxruntime import _helpers  # noqa: F401  (skips without onnxruntime)

import onnx  # noqa: E402
import onnx_ir as ir  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from graphopt.backends.onnxruntime.onnx_passes.matmul_reshapes import fold_flattened_matmuls  # noqa: E402
from graphopt.backends.onnxruntime.runtime.session import create_session  # noqa: E402

K, N = 8, 6


def _model(unflatten_dims=("B", "S", N), weight_shape=(K, N), extra_use: bool = False,
           output_from_matmul: bool = False) -> ir.Model:
    """x [B, S, K] -> Reshape [B*S, K] -> MatMul w -> Reshape ``unflatten_dims`` -> y (+ an Abs of the
    MatMul's output when ``extra_use``). The Reshape targets are computed from Shape, as a dynamic
    export spells them; value_info carries the symbolic shapes the export's metadata gives."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal(weight_shape).astype(np.float32), "w")
    flat_shape = numpy_helper.from_array(np.array([-1, K], np.int64), "flat_shape")
    tail = numpy_helper.from_array(np.array([unflatten_dims[-1]] if isinstance(unflatten_dims[-1], int) else [-1],
                                            np.int64), "tail")
    nodes = [
        helper.make_node("Reshape", ["x", "flat_shape"], ["flat"]),
        helper.make_node("MatMul", ["flat", "w"], ["mm"]),
        helper.make_node("Shape", ["x"], ["lead"], start=0, end=2),
        helper.make_node("Concat", ["lead", "tail"], ["out_shape"], axis=0),
        helper.make_node("Reshape", ["mm", "out_shape"], ["y"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(unflatten_dims))]
    if extra_use:
        nodes.append(helper.make_node("Abs", ["mm"], ["mm_abs"]))
        outputs.append(helper.make_tensor_value_info("mm_abs", TensorProto.FLOAT, ["BS", N]))
    if output_from_matmul:
        outputs.append(helper.make_tensor_value_info("mm", TensorProto.FLOAT, ["BS", N]))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", K])], outputs,
        [w, flat_shape, tail],
        value_info=[helper.make_tensor_value_info("flat", TensorProto.FLOAT, ["BS", K]),
                    *([] if output_from_matmul or extra_use
                      else [helper.make_tensor_value_info("mm", TensorProto.FLOAT, ["BS", N])])])
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


def _run(model: ir.Model, x: np.ndarray) -> list[np.ndarray]:
    return create_session(ir.to_proto(model).SerializeToString(), "cpu").run(None, {"x": x})


def test_folds_flatten_matmul_unflatten_and_keeps_the_output_name_and_values():
    model = _model()
    x = np.random.default_rng(1).standard_normal((3, 5, K)).astype(np.float32)
    expected = _run(model, x)
    assert fold_flattened_matmuls(model) == 1
    ops = Counter(n.op_type for n in model.graph)
    assert ops == {"MatMul": 1}, ops
    assert [v.name for v in model.graph.outputs] == ["y"]
    assert model.graph.outputs[0].producer().op_type == "MatMul"
    np.testing.assert_allclose(_run(model, x)[0], expected[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["leading_dims_differ", "batched_weight", "matmul_read_twice", "matmul_is_output"])
def test_leaves_what_it_cannot_prove(case):
    kwargs = {"leading_dims_differ": {"unflatten_dims": ("S", "B", N)},
              "batched_weight": {"weight_shape": (1, K, N)},
              "matmul_read_twice": {"extra_use": True},
              "matmul_is_output": {"output_from_matmul": True}}[case]
    model = _model(**kwargs)
    before = Counter(n.op_type for n in model.graph)
    assert fold_flattened_matmuls(model) == 0
    assert Counter(n.op_type for n in model.graph) == before


def test_dynamic_linear_export_returns_the_matmul_output_and_matches_eager():
    """Through the exporter: a Linear on [B, S, K] with both axes dynamic leaves no Reshape, and
    the session matches eager at a shape it was not exported at."""
    from torch.export import Dim

    weight = torch.randn(N, K)

    def fn(self, x):
        return torch.nn.functional.linear(x, self.weight).relu()

    module = _helpers.Call(fn, weight=weight)
    x = torch.randn(2, 3, K)
    batch, seq = Dim("batch", min=2), Dim("seq", min=2)
    other = torch.randn(4, 7, K)
    (out,), exported = _helpers.export_and_run(module, x, dynamic_shapes=[{0: batch, 1: seq}], run_inputs=[other])
    ops = Counter(n.op_type for n in exported.model.graph)
    assert "Reshape" not in ops, ops
    torch.testing.assert_close(out, module(other), rtol=1e-5, atol=1e-5)
