"""Errors of the ONNX Runtime target. Each is one line for the user and, where it is about
a graph, names the op so the fallback warning says what could not be lowered."""

from __future__ import annotations

from graphopt.errors import GraphoptError, TargetUnavailable


class OnnxExportError(GraphoptError):
    """The graph could not be turned into an ONNX model."""


class UnsupportedOp(OnnxExportError):
    """An op in the graph has no ONNX translation (or none for the way it is called)."""

    def __init__(self, op: str, reason: str = "") -> None:
        self.op = op
        detail = f": {reason}" if reason else ""
        super().__init__(f"op {op} cannot be exported to ONNX Runtime{detail}")


class ProviderUnavailable(TargetUnavailable):
    """An execution provider that this onnxruntime build does not have."""
