"""Large float weights fed as inputs (fed_weights.py): opening a session copies none of them,
the runner feeds them and computes what the module does, and only weights that lose nothing as
inputs are fed (no reader ORT could fold, not small, not in a subgraph, not a quantized graph's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from graphopt.backends.onnxruntime.lower.export import export_graph
from graphopt.backends.onnxruntime.runtime.fed_weights import FED_MIN_BYTES, feedable, make_inputs
from graphopt.backends.onnxruntime.runtime.heap_trim import release_free_heap
from graphopt.backends.onnxruntime.runtime.session import SessionRunner, create_session
from graphopt.frontend.trace import export_aten_graph

HIDDEN, LAYERS = 1024, 16  # 64 MB of float32 weights


def _model(rows: int = 4):
    torch.manual_seed(0)
    module = torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(LAYERS)]).eval()
    x = torch.randn(rows, HIDDEN)
    program = export_aten_graph(module, (x,))
    return module, export_graph(program.gm, program.example_inputs, dynamic=False), x


def _peak_growth(open_session) -> tuple[int, object]:
    """How far resident memory peaks above where it was while ``open_session()`` runs."""
    release_free_heap()
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # resets VmHWM, the peak, to the current resident size
    except OSError:
        pytest.skip("this kernel cannot reset the peak resident size (/proc/self/clear_refs)")
    before = _status("VmRSS")
    session = open_session()
    return _status("VmHWM") - before, session


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field))


def test_opening_the_session_copies_no_fed_weight_and_it_computes_as_the_module():
    module, model, x = _model()
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    fed_growth, session = _peak_growth(lambda: create_session(model, feed_weights=True))
    runner = SessionRunner(session)
    assert len(session._graphopt_feeds) == LAYERS and runner.input_names == model.input_names  # noqa: SLF001
    assert fed_growth < weights / 5, f"opening the session peaked {fed_growth} B above; weights {weights} B"
    with torch.no_grad():
        want = module(x)
        torch.testing.assert_close(runner(x)[0], want, rtol=1e-4, atol=1e-4)
        out = torch.empty_like(want)  # the IOBinding path binds the weights too
        torch.testing.assert_close(runner.run_into([x], [out])[0], want, rtol=1e-4, atol=1e-4)
        module[0].weight.mul_(2)  # the session reads the module's buffers at every run
        torch.testing.assert_close(runner(x)[0], module(x), rtol=1e-4, atol=1e-4)
    # the measurement sees a copy where there is one: loaded as initializers, ORT copies them while it opens
    loaded_growth, _ = _peak_growth(lambda: create_session(model))
    assert loaded_growth > weights * 0.8


def _graph(nodes, initializers, inputs=("x",)):
    values = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in inputs]
    out = helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.FLOAT, None)
    return helper.make_graph(nodes, "g", values, [out], initializer=initializers)


def _weight(name: str, rows: int = 512, cols: int = 1024):
    return helper.make_tensor(name, TensorProto.FLOAT, [rows, cols], np.ones(rows * cols, np.float32))


def test_only_weights_no_reader_could_fold_are_fed():
    big = 512 * 1024 * 4
    assert big >= FED_MIN_BYTES
    graph = _graph([
        helper.make_node("MatMul", ["x", "w"], ["a"]),  # reads x: fed
        helper.make_node("Transpose", ["t"], ["tt"]),  # constants only: ORT folds it
        helper.make_node("MatMul", ["a", "tt"], ["b"]),
        helper.make_node("Mul", ["c", "k"], ["ck"]),  # k is constant, but so is c: folded
        helper.make_node("MatMul", ["b", "ck"], ["d"]),
        helper.make_node("Gather", ["e", "ids"], ["y"]),  # the ids are computed: fed
        helper.make_node("MatMul", ["d", "small"], ["z"]),
    ], [_weight("w"), _weight("t"), _weight("c"), _weight("k"), _weight("e"), _weight("small", 2, 8)],
        inputs=("x", "ids"))
    assert feedable(graph, ["w", "t", "c", "k", "e", "small"]) == {"w", "e"}
    make_inputs(graph, {"w", "e"})
    assert [t.name for t in graph.initializer] == ["t", "c", "k", "small"]
    inputs = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in graph.input}
    assert inputs == {"x": [], "ids": [], "w": [512, 1024], "e": [512, 1024]}


def test_a_weight_read_in_a_subgraph_is_not_fed():
    branch = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["r"])], "branch", [],
                               [helper.make_tensor_value_info("r", TensorProto.FLOAT, None)])
    graph = _graph([helper.make_node("MatMul", ["x", "w"], ["a"]),
                    helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch)],
                   [_weight("w")], inputs=("x", "cond"))
    assert feedable(graph, ["w"]) == set()


def test_a_quantized_graph_keeps_its_weights_loaded():
    """MatMulNBits prepacks its weights at load, which needs them as initializers."""
    import onnx_ir as ir

    codes = np.random.default_rng(0).integers(0, 255, (4096, 8, 16), dtype=np.uint8)  # 2 MB
    scales = np.full((4096 * 8,), 0.01, np.float32)
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, 256]))
    w = ir.Value(name="w", const_value=ir.tensor(np.ones((256, 1024), np.float32)))  # 1 MB float weight
    node = ir.Node("com.microsoft", "MatMulNBits", [x, ir.Value(name="codes", const_value=ir.tensor(codes)),
                                                    ir.Value(name="scales", const_value=ir.tensor(scales))],
                   attributes=[ir.AttrInt64("K", 256), ir.AttrInt64("N", 4096), ir.AttrInt64("bits", 4),
                               ir.AttrInt64("block_size", 32)])
    matmul = ir.Node("", "MatMul", [x, w])
    graph = ir.Graph([x], [node.outputs[0], matmul.outputs[0]], nodes=[node, matmul],
                     initializers=[node.inputs[1], node.inputs[2], w],
                     opset_imports={"": 20, "com.microsoft": 1})
    from graphopt.backends.onnxruntime.lower.onnx_model import OnnxModel

    session = create_session(OnnxModel(ir.Model(graph, ir_version=10), ["x"], ["y", "z"]), feed_weights=True)
    assert session._graphopt_feeds == {}  # noqa: SLF001
    assert [i.name for i in session.get_inputs()] == ["x"]
