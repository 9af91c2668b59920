"""Sessions compute on the module's weights: a second session (another compiled shape, a
recompile) adds no copy of them, and neither does the first.

Under ``torch.compile`` the user's module holds its weights; before, every CPU session held a
copy of its own (ORT's copy of each handed-over weight, then its MatMul kernels' prepacked
layout): transformers' generate on Qwen2.5-Coder-0.5B peaked at 2.6x eager's memory. Here a
model whose weights are far larger than anything else in the process is opened as two sessions
(a prefill's static shape and a decode step's), and each may grow the process's resident memory
by at most a fifth of the weights. The buffers handed to ORT are the module's own.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime
import torch

from graphopt.backends.onnxruntime.lower.export import export_graph
from graphopt.backends.onnxruntime.runtime.heap_trim import release_free_heap
from graphopt.backends.onnxruntime.runtime.session import SessionRunner, create_session
from graphopt.backends.onnxruntime.runtime.weights_in_memory import prepacking_pays, serialize_sharing_weights
from graphopt.frontend.trace import export_aten_graph

HIDDEN, LAYERS = 1024, 16  # 64 MB of float32 weights


def _module() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(LAYERS)]).eval()


def _model(module: torch.nn.Module, rows: int):
    x = torch.randn(rows, HIDDEN)
    program = export_aten_graph(module, (x,))
    return export_graph(program.gm, program.example_inputs, dynamic=False), x


def _resident_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))


def _weight_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_two_sessions_add_no_copy_of_the_weights():
    module = _module()
    weights = _weight_bytes(module)
    built = [_model(module, rows) for rows in (8, 1)]  # a prefill's shape, then a decode step's
    sessions, growth = [], []
    for model, _ in built:
        release_free_heap()
        before = _resident_bytes()
        sessions.append(create_session(model))
        release_free_heap()
        growth.append(_resident_bytes() - before)
    assert all(g < weights / 5 for g in growth), f"sessions grew resident memory by {growth} B; weights {weights} B"
    with torch.no_grad():
        for session, (_, x) in zip(sessions, built):
            torch.testing.assert_close(SessionRunner(session)(x)[0], module(x), rtol=1e-4, atol=1e-4)


def test_every_weight_handed_to_ort_is_the_modules_buffer():
    """Across two compiled shapes, the distinct bytes handed over that the module does not
    hold are none (a copy of ours, kept for the session, would count here)."""
    module = _module()
    params = [p.detach().numpy() for p in module.parameters()]
    handed = []
    for rows in (8, 1):
        model, _ = _model(module, rows)
        arrays, _ = serialize_sharing_weights(model, onnxruntime.SessionOptions())[1]
        handed += arrays
    assert sum(a.nbytes for a in handed) == 2 * _weight_bytes(module)
    copies = [a for a in handed if not any(np.shares_memory(a, p) for p in params)]
    assert sum(a.nbytes for a in copies) == 0


def test_prepacking_stays_on_for_a_quantized_matmul():
    """MatMulNBits' speed is its prepacked layout; float MatMuls read the weights in place."""
    def x():
        return ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, 64]))

    x1 = x()
    w = ir.Value(name="w", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([64, 64]))
    matmul = ir.Node("", "MatMul", [x1, w], num_outputs=1)
    plain = ir.Graph([x1, w], matmul.outputs, nodes=[matmul])
    assert not prepacking_pays(plain)
    codes = ir.Value(name="codes", type=ir.TensorType(ir.DataType.UINT8), shape=ir.Shape([64, 2, 16]))
    scales = ir.Value(name="scales", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([128]))
    x2 = x()
    nbits = ir.Node("com.microsoft", "MatMulNBits", [x2, codes, scales], attributes=[ir.AttrInt64("K", 64)],
                    num_outputs=1)
    quantized = ir.Graph([x2, codes, scales], nbits.outputs, nodes=[nbits])
    assert prepacking_pays(quantized)
