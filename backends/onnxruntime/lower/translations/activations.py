"""Activations -> ONNX Runtime's GELU ops and the standard gated forms.

- ``graphopt.bias_gelu(x, b, "none")`` -> ``com.microsoft.BiasGelu(x, b)`` (``Gelu`` without b)
- ``graphopt.bias_gelu(x, b, "tanh")`` -> ``com.microsoft.FastGelu(x, b)`` (the tanh formula
  torch uses, to the constant)
- ``graphopt.swiglu(gate_up)`` -> ``Split`` + ``x * Sigmoid(x)`` + ``Mul``: ORT has no
  SwiGLU kernel on the CPU, and its optimizer fuses ``x * Sigmoid(x)`` itself
- ``graphopt.geglu(gate_up, a)`` -> ``Split`` + ``Gelu``/``FastGelu`` + ``Mul``

The contrib GELUs are used rather than opset 20's ``Gelu`` so the model does not depend on
the exported opset. BiasGelu/FastGelu add a bias of shape [N] over the last axis in the
input's dtype; any other bias (mixed dtypes, another shape) is added with ``Add`` first.
"""

from __future__ import annotations

import torch

from graphopt.backends.onnxruntime.lower.translations._common import cast_to, dims_equal, ms, op, promote, rank

graphopt = torch.ops.graphopt


def _gelu(x, approximate: str):
    return ms.FastGelu(x) if approximate == "tanh" else ms.Gelu(x)


def _fits_fused_bias(x, bias) -> bool:
    return (bias.dtype == x.dtype and rank(bias) == 1 and x.shape is not None
            and dims_equal(bias.shape[0], x.shape[-1]))


def bias_gelu(x, bias, approximate: str = "none"):
    if bias is None:
        return _gelu(x, approximate)
    if not _fits_fused_bias(x, bias):
        dtype = promote(x, bias)
        return _gelu(op.Add(cast_to(x, dtype), cast_to(bias, dtype)), approximate)
    if approximate == "tanh":
        return ms.FastGelu(x, bias)
    return ms.BiasGelu(x, bias)


def swiglu(gate_up):
    gate, up = op.Split(gate_up, axis=-1, num_outputs=2)
    return op.Mul(op.Mul(gate, op.Sigmoid(gate)), up)


def geglu(gate_up, approximate: str = "none"):
    gate, up = op.Split(gate_up, axis=-1, num_outputs=2)
    return op.Mul(_gelu(gate, approximate), up)


TRANSLATIONS = {
    graphopt.bias_gelu.default: bias_gelu,
    graphopt.swiglu.default: swiglu,
    graphopt.geglu.default: geglu,
}
