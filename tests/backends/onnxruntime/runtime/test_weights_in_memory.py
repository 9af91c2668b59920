"""A CPU session takes an in-memory model's weights as OrtValues, not out of serialized bytes:
the same outputs as a session on the whole model's bytes, bytes that hold no weight, the
model left as it was, and a session that computes on the module's own buffers (an in-place
edit of the module after the build reaches it, as it reaches eager torch)."""

from __future__ import annotations

import numpy as np
import onnxruntime
import torch

from graphopt.backends.onnxruntime.lower.export import export_graph
from graphopt.backends.onnxruntime.runtime.session import SessionRunner, create_session
from graphopt.backends.onnxruntime.runtime.weights_in_memory import IN_MEMORY, MIN_BYTES, serialize_sharing_weights
from graphopt.frontend.trace import export_aten_graph
from tests.backends.onnxruntime._helpers import Call


def _exported():
    torch.manual_seed(0)
    # w and the table are large (handed over); b is under MIN_BYTES (stays in the bytes);
    # the int64 index table covers a non-float dtype.
    module = Call(lambda s, x, i: (x @ s.w + s.b, s.table[i].sum(-1) + s.index[i].float()),
                  w=torch.randn(64, 32), b=torch.randn(32), table=torch.randn(100, 16),
                  index=torch.arange(100, dtype=torch.int64) * 3)
    x, i = torch.randn(4, 64), torch.tensor([[1, 5, 99]])
    program = export_aten_graph(module, (x, i))
    return module, (x, i), export_graph(program.gm, program.example_inputs, dynamic=False)


def test_outputs_equal_a_session_on_the_whole_models_bytes():
    module, inputs, model = _exported()
    whole = onnxruntime.InferenceSession(model.to_bytes(), providers=["CPUExecutionProvider"])
    shared = create_session(model)
    feeds = {i.name: t.numpy() for i, t in zip(whole.get_inputs(), inputs)}
    for got, want, eager in zip(shared.run(None, feeds), whole.run(None, feeds), module(*inputs)):
        np.testing.assert_array_equal(got, want)
        torch.testing.assert_close(torch.from_numpy(got), eager, rtol=1e-5, atol=1e-5)


def test_the_bytes_hold_no_large_weight_and_the_model_is_left_as_it_was():
    _, _, model = _exported()
    before = {name: value.const_value for name, value in model.model.graph.initializers.items()}
    large = sum(t.nbytes for t in before.values() if t.nbytes >= MIN_BYTES)
    assert large >= 64 * 32 * 4 + 100 * 16 * 4
    options = onnxruntime.SessionOptions()
    data, keep, _ = serialize_sharing_weights(model, options)
    assert len(data) < len(model.to_bytes()) - large + 1024 and IN_MEMORY.encode() in data
    arrays, values = keep
    assert len(arrays) == len(values) == sum(t.nbytes >= MIN_BYTES for t in before.values())
    assert {name: value.const_value for name, value in model.model.graph.initializers.items()} == before


def test_the_session_computes_on_the_modules_buffers_an_edit_of_the_module_reaches_it():
    """The OrtValues are views of the weights where they can be (no copy of ours), and the
    session reads them in place (no copy of ORT's): an edit of the module shows in its outputs."""
    module, inputs, model = _exported()
    arrays, _ = serialize_sharing_weights(model, onnxruntime.SessionOptions())[1]
    table = module.table.detach().numpy()
    assert any(np.shares_memory(a, table) for a in arrays)  # handed over as a view, not a copy
    runner = SessionRunner(create_session(model))
    first = runner(*inputs)
    with torch.no_grad():
        module.w.mul_(2)
        module.table.zero_()
    after = runner(*inputs)
    for got, want, before in zip(after, module(*inputs), first):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert not torch.equal(got, before)
