"""Fixtures shared by the onnxruntime target's tests."""

import pytest


@pytest.fixture
def ort_models(monkeypatch):
    """The ONNX models the target exports during a test, in order."""
    from graphopt.backends.onnxruntime.lower import export as export_module

    models = []
    real = export_module.export_graph

    def keep(*args, **kwargs):
        models.append(real(*args, **kwargs))
        return models[-1]

    monkeypatch.setattr(export_module, "export_graph", keep)
    return models
