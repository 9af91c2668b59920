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


class MissingKernel(GraphoptError):
    """The provider has no kernel for an op of the exported model at its types."""

    def __init__(self, op: str, provider: str, bfloat16: bool, in_code: bool = False) -> None:
        self.op = op
        if in_code:  # the weights and inputs are not bfloat16: casting the model cannot help
            message = (f"ONNX Runtime's {provider} provider has no bfloat16 kernel for {op}, and the model's own "
                       "code computes in bfloat16 whatever its dtype (e.g. Falcon's ALiBi bias); use target='eager'")
        elif bfloat16:
            message = (f"ONNX Runtime's {provider} provider has no bfloat16 kernel for {op}: run the model in "
                       "float32 or float16 (model.float()), or use target='eager'")
        else:
            message = (f"ONNX Runtime's {provider} provider has no kernel for {op} at this graph's types; "
                       "use target='eager' for it")
        super().__init__(message)
