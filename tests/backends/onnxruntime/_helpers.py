"""Export a module through graphopt's torch.export frontend and run it in ONNX Runtime."""

from __future__ import annotations

from typing import Any, Sequence

import pytest
import torch

pytest.importorskip("onnxruntime", reason="the onnxruntime target needs onnxruntime: pip install 'graphopt[onnxruntime]'")
pytest.importorskip("onnxscript", reason="the onnxruntime target needs onnxscript: pip install 'graphopt[onnxruntime]'")

from graphopt.backends.onnxruntime.lower.export import export_graph  # noqa: E402
from graphopt.backends.onnxruntime.lower.onnx_model import OnnxModel  # noqa: E402
from graphopt.backends.onnxruntime.runtime.session import SessionRunner, create_session  # noqa: E402
from graphopt.frontend.trace import export_aten_graph  # noqa: E402


class Call(torch.nn.Module):
    """A module whose forward is ``fn(*inputs)``, holding ``weights`` as parameters."""

    def __init__(self, fn, **weights: torch.Tensor) -> None:
        super().__init__()
        self.fn = fn
        for name, w in weights.items():
            self.register_parameter(name, torch.nn.Parameter(w, requires_grad=False))

    def forward(self, *inputs):
        return self.fn(self, *inputs)


def export_and_run(module: torch.nn.Module, *inputs: torch.Tensor, dynamic_shapes: Any = None,
                   run_inputs: Sequence[torch.Tensor] | None = None) -> tuple[list[torch.Tensor], OnnxModel]:
    """(ORT outputs on ``run_inputs`` or ``inputs``, the exported model). ``dynamic_shapes``:
    one spec per input (a ``Call``'s forward takes them as one ``*inputs`` tuple)."""
    if dynamic_shapes is not None and isinstance(module, Call):
        dynamic_shapes = (tuple(dynamic_shapes),)
    program = export_aten_graph(module, inputs, dynamic_shapes=dynamic_shapes)
    model = export_graph(program.gm, program.example_inputs)
    outputs = SessionRunner(create_session(model))(*(run_inputs or inputs))
    return outputs, model


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm()).item()
