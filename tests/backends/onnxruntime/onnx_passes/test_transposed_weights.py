"""A CPU session reads a Linear's weight as torch holds it: the MatMuls that read its transpose
become FusedMatMul(transB=1) in the bytes the session is made from, with no transposed copy;
every other reader keeps its form (transposed_weights.py)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime
import torch
from onnx import TensorProto, helper, numpy_helper

from graphopt.backends.onnxruntime.lower.export import export_graph
from graphopt.backends.onnxruntime.runtime.session import SessionRunner, create_session
from graphopt.backends.onnxruntime.onnx_passes.transposed_weights import multiply_by_transposes, transposed_matmul_weights
from graphopt.backends.onnxruntime.runtime.weights_in_memory import serialize_sharing_weights
from graphopt.frontend.trace import export_aten_graph
from tests.backends.onnxruntime._helpers import Call


def _session_bytes(model) -> tuple[onnx.ModelProto, list]:
    data, (arrays, _), _ = serialize_sharing_weights(model, onnxruntime.SessionOptions())
    proto = onnx.ModelProto()
    proto.ParseFromString(data)
    return proto, arrays


def _ops(proto: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in proto.graph.node]


def test_a_linear_weight_is_handed_over_as_torch_holds_it_and_read_transposed():
    torch.manual_seed(0)
    module = Call(lambda s, x: torch.relu(x @ s.w1.t()) @ s.w2.t(), w1=torch.randn(48, 32), w2=torch.randn(16, 48))
    x = torch.randn(2, 5, 32)
    program = export_aten_graph(module, (x,))
    model = export_graph(program.gm, program.example_inputs, dynamic=False)
    whole = onnxruntime.InferenceSession(model.to_bytes(), providers=["CPUExecutionProvider"])
    proto, arrays = _session_bytes(model)
    fused = [n for n in proto.graph.node if n.op_type == "FusedMatMul"]
    assert len(fused) == 2 and "MatMul" not in _ops(proto)
    assert all(helper.get_attribute_value(next(a for a in n.attribute if a.name == "transB")) == 1 for n in fused)
    dims = {t.name: list(t.dims) for t in proto.graph.initializer}
    assert sorted(dims[n.input[1]] for n in fused) == [[16, 48], [48, 32]]
    for weight in (module.w1, module.w2):  # no copy of ours: views of the parameters
        assert any(np.shares_memory(a, weight.detach().numpy()) for a in arrays)
    assert "MatMul" in [n.op_type for n in model.to_proto().graph.node]  # the model itself is unchanged

    got = SessionRunner(create_session(model))(x)[0]
    want = whole.run(None, {whole.get_inputs()[0].name: x.numpy()})[0]
    torch.testing.assert_close(got, torch.from_numpy(want), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, module(x), rtol=1e-5, atol=1e-5)


def _two_linears():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(32, 48, bias=False), torch.nn.ReLU(), torch.nn.Linear(48, 16, bias=False))
    return module, torch.randn(2, 5, 32)


TWO_LINEARS_RECORD = {"matches": 2, "weights": 2, "bytes": (48 * 32 + 16 * 48) * 4}


def test_the_rewrite_is_reported_as_an_onnx_pass_after_the_exports():
    """onnx:transposed_weights in the graph's report, once, after the export's passes: the
    MatMuls it made FusedMatMul, the weights handed over with no transposed copy, their bytes."""
    import graphopt

    module, x = _two_linears()
    graphopt.reset()
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="graphopt",
                             options={"target": "onnxruntime", "provider": "cpu", "fallback": "error"})
    with torch.no_grad():
        for _ in range(2):  # a build may wait for the second call (lazy_build.py)
            torch.testing.assert_close(compiled(x), module(x), rtol=1e-5, atol=1e-5)
    (report,) = graphopt.reports()
    onnx_names = [p.name for p in report.passes if p.name.startswith("onnx:")]
    assert onnx_names[-1] == "onnx:transposed_weights" and onnx_names.count("onnx:transposed_weights") == 1
    record = report.passes[-1]
    assert record.status == "changed" and record.matches == 2 and record.stats == TWO_LINEARS_RECORD
    assert record.nodes_before == record.nodes_after  # node for node: MatMul -> FusedMatMul


def test_graphopt_debug_lists_it_and_a_session_made_from_bytes_has_none():
    from graphopt.backends.onnxruntime.exporter import onnx_exporter
    from graphopt.backends.onnxruntime.runtime.session import session_passes

    module, x = _two_linears()
    program = export_aten_graph(module, (x,))
    model = export_graph(program.gm, program.example_inputs, dynamic=False)
    assert "onnx:transposed_weights" not in [r.name for r in model.passes.records]  # the model is not rewritten
    (made,) = session_passes(create_session(model)).records
    assert made.name == "onnx:transposed_weights" and made.stats == TWO_LINEARS_RECORD
    assert session_passes(create_session(model.to_bytes())).records == []  # its bytes as they are

    lowered = onnx_exporter.lower_graph(program.gm, program.example_inputs)  # graphopt debug --target onnxruntime
    last = onnx_exporter.pass_records(lowered)[-1]
    assert last.name == "onnx:transposed_weights" and last.stats == TWO_LINEARS_RECORD


def _model(nodes, initializers, inputs, outputs) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _value(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _run(proto: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    session = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def test_matmul_of_a_transposed_initializer_reads_the_initializer_and_the_transpose_goes():
    """A tied LM head: the table feeds a Gather and, through a Transpose, the head's MatMul."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((40, 8)).astype(np.float32)
    proto = _model(
        [helper.make_node("Gather", ["table", "ids"], ["emb"]),
         helper.make_node("Transpose", ["table"], ["table_t"], perm=[1, 0]),
         helper.make_node("MatMul", ["emb", "table_t"], ["logits"])],
        [numpy_helper.from_array(table, "table")],
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 3])], [_value("logits", [1, 3, 40])])
    feeds = {"ids": np.array([[1, 7, 39]], dtype=np.int64)}
    want = _run(proto, feeds)[0]
    result = multiply_by_transposes(proto.graph, {}, proto.opset_import)
    assert result.changed == 1 and result.stats == {"weights": 1, "bytes": 40 * 8 * 4}  # no transposed table
    assert _ops(proto) == ["Gather", "FusedMatMul"]
    assert proto.graph.node[1].input[1] == "table"
    np.testing.assert_allclose(_run(proto, feeds)[0], want, rtol=1e-6, atol=1e-6)


def _matmul_by_transpose_then(node, extra_initializers, outputs) -> onnx.ModelProto:
    """y = x @ Transpose(w), x [2, 4], w [6, 4]; then ``node``."""
    w = np.random.default_rng(1).standard_normal((6, 4)).astype(np.float32)
    return _model([helper.make_node("Transpose", ["w"], ["w_t"], perm=[1, 0]),
                   helper.make_node("MatMul", ["x", "w_t"], ["y"]), node],
                  [numpy_helper.from_array(w, "w"), *extra_initializers], [_value("x", [2, 4])], outputs)


def test_a_transpose_read_by_another_op_stays_for_it():
    proto = _matmul_by_transpose_then(helper.make_node("Relu", ["w_t"], ["r"]), [],
                                      [_value("y", [2, 6]), _value("r", [4, 6])])
    feeds = {"x": np.random.default_rng(2).standard_normal((2, 4)).astype(np.float32)}
    want = _run(proto, feeds)
    result = multiply_by_transposes(proto.graph, {}, proto.opset_import)
    assert result.changed == 1 and result.stats == {"weights": 0, "bytes": 0}  # ORT still copies it for the Relu
    assert _ops(proto) == ["Transpose", "FusedMatMul", "Relu"]
    for got, expected in zip(_run(proto, feeds), want):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_a_matmul_that_feeds_an_add_keeps_its_form_for_orts_gemm_fusion():
    proto = _matmul_by_transpose_then(helper.make_node("Add", ["y", "b"], ["z"]),
                                      [numpy_helper.from_array(np.ones(6, np.float32), "b")], [_value("z", [2, 6])])
    assert multiply_by_transposes(proto.graph, {}, proto.opset_import).changed == 0
    assert _ops(proto) == ["Transpose", "MatMul", "Add"]
    assert not any(o.domain == "com.microsoft" for o in proto.opset_import)


def test_a_transpose_of_a_3d_initializer_or_another_perm_is_left():
    w3 = np.zeros((2, 3, 4), np.float32)
    proto = _model(
        [helper.make_node("Transpose", ["w3"], ["w3_t"], perm=[0, 2, 1]),
         helper.make_node("MatMul", ["x", "w3_t"], ["y"])],
        [numpy_helper.from_array(w3, "w3")], [_value("x", [2, 5, 4])], [_value("y", [2, 5, 3])])
    assert multiply_by_transposes(proto.graph, {}, proto.opset_import).changed == 0
    assert _ops(proto) == ["Transpose", "MatMul"]


def _ir_graph(nodes, initializers, inputs, outputs) -> ir.Graph:
    return ir.serde.deserialize_model(_model(nodes, initializers, inputs, outputs)).graph


def test_only_initializers_read_solely_as_a_matmuls_b_are_read_transposed():
    rng = np.random.default_rng(3)
    arrays = {name: rng.standard_normal((4, 4)).astype(np.float32) for name in ("b_only", "also_a", "biased", "in_if")}
    branch = helper.make_graph([helper.make_node("MatMul", ["x", "in_if"], ["t"])], "then", [], [_value("t", [4, 4])])
    graph = _ir_graph(
        [helper.make_node("MatMul", ["x", "b_only"], ["y1"]),
         helper.make_node("MatMul", ["x", "also_a"], ["y2"]),
         helper.make_node("MatMul", ["also_a", "x"], ["y3"]),  # read as A too
         helper.make_node("MatMul", ["x", "biased"], ["y4"]),
         helper.make_node("Add", ["y4", "x"], ["y5"]),  # a bias: ORT's Gemm fusion keeps it
         helper.make_node("If", ["cond"], ["y6"], then_branch=branch, else_branch=branch)],  # a subgraph reads in_if
        [numpy_helper.from_array(a, name) for name, a in arrays.items()],
        [_value("x", [4, 4]), helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [_value(n, [4, 4]) for n in ("y1", "y2", "y3", "y5", "y6")])
    assert transposed_matmul_weights(graph) == {"b_only"}


def test_a_flipped_initializer_gets_its_new_dims_and_loses_a_contradicting_value_info():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((3, 5)).astype(np.float32)  # W as torch holds it: [out, in]
    proto = _model([helper.make_node("MatMul", ["x", "w"], ["y"])], [numpy_helper.from_array(w.T.copy(), "w")],
                   [_value("x", [2, 5])], [_value("y", [2, 3])])
    proto.graph.value_info.append(_value("w", [5, 3]))
    feeds = {"x": rng.standard_normal((2, 5)).astype(np.float32)}
    want = _run(proto, feeds)[0]
    proto.graph.initializer[0].CopyFrom(numpy_helper.from_array(w, "w"))  # the weight as handed over
    proto.graph.initializer[0].dims[:] = [5, 3]  # as the serialized model declares it
    result = multiply_by_transposes(proto.graph, {"w": (3, 5)}, proto.opset_import)
    assert result.changed == 1 and result.stats == {"weights": 1, "bytes": 3 * 5 * 4}
    assert list(proto.graph.initializer[0].dims) == [3, 5] and not proto.graph.value_info
    np.testing.assert_allclose(_run(proto, feeds)[0], want, rtol=1e-6, atol=1e-6)


def test_a_weight_that_is_not_float32_keeps_its_matmul():
    """FusedMatMul's CPU kernel is float32's; other types keep MatMul as before."""
    w16 = np.zeros((4, 4), np.float16)
    nodes = [helper.make_node("MatMul", ["x", "w16"], ["y"]),
             helper.make_node("Transpose", ["w16"], ["w16_t"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "w16_t"], ["z"])]
    x16 = helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 4])
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT16, [2, 4]) for n in ("y", "z")]
    graph = _ir_graph(nodes[:1], [numpy_helper.from_array(w16, "w16")], [x16], outputs[:1])
    assert transposed_matmul_weights(graph) == set()
    proto = _model(nodes[1:], [numpy_helper.from_array(w16, "w16")], [x16], outputs[1:])
    assert multiply_by_transposes(proto.graph, {}, proto.opset_import).changed == 0
    assert _ops(proto) == ["Transpose", "MatMul"]
