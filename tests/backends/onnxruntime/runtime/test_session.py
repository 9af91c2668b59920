"""Sessions: providers that are not installed say which package to install; tensors cross
into and out of ORT without copies, by numpy views on the CPU and by IOBinding + DLPack
(the path GPU tensors and bfloat16 take)."""

from __future__ import annotations

import pytest
import torch

from graphopt.backends.onnxruntime.errors import ProviderUnavailable
from graphopt.backends.onnxruntime.runtime.session import SessionRunner, create_session, provider_problem
from tests.backends.onnxruntime._helpers import Call, export_and_run  # noqa: F401  (skips without onnxruntime)


@pytest.fixture(scope="module")
def runner_and_inputs():
    from graphopt.backends.onnxruntime.lower.export import export_graph
    from graphopt.frontend.trace import export_aten_graph

    module = Call(lambda s, x, y: (x @ s.w + y, (x * 2).sum(-1)), w=torch.randn(8, 8))
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    program = export_aten_graph(module, (x, y))
    model = export_graph(program.gm, program.example_inputs)
    return create_session(model), module, (x, y)


@pytest.mark.parametrize("provider, package", [("cuda", "onnxruntime-gpu"), ("rocm", "onnxruntime-rocm"),
                                               ("migraphx", "onnxruntime-migraphx")])
def test_missing_provider_names_its_package(provider, package):
    assert provider_problem(provider) == f"provider {provider} needs {package}: pip install {package}"
    with pytest.raises(ProviderUnavailable, match=f"pip install {package}"):
        create_session(b"", provider)


def test_cpu_run_returns_torch_tensors_over_ort_buffers(runner_and_inputs):
    session, module, inputs = runner_and_inputs
    outputs = SessionRunner(session)(*inputs)
    for got, want in zip(outputs, module(*inputs)):
        assert isinstance(got, torch.Tensor)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("static_outputs", [True, False])
def test_io_binding_writes_into_preallocated_or_ort_allocated_outputs(runner_and_inputs, static_outputs):
    session, module, inputs = runner_and_inputs
    specs = [((3, 8), torch.float32), ((3,), torch.float32)] if static_outputs else None
    runner = SessionRunner(session, specs)
    runner.cpu_only = False  # as for a GPU provider: bind instead of session.run
    x, y = inputs
    outputs = runner(x.t().contiguous().t(), y)  # a non-contiguous input is made contiguous first
    for got, want in zip(outputs, module(*inputs)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_wrong_input_count_is_one_line(runner_and_inputs):
    session, _, inputs = runner_and_inputs
    with pytest.raises(ValueError, match="takes 2 inputs, got 1"):
        SessionRunner(session)(inputs[0])


def test_a_session_does_not_keep_the_model_bytes(runner_and_inputs):
    """ORT's Python session would hold the serialized model (every weight again) for its whole
    life; graphopt drops that copy, and the session still runs."""
    session, module, inputs = runner_and_inputs
    assert getattr(session, "_model_bytes", None) is None
    for got, want in zip(SessionRunner(session)(*inputs), module(*inputs)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
