"""What every translation module shares: the opsets it emits and small shape helpers.

A translation is a plain Python function that torch.onnx's exporter traces: it is called
with one ONNX value (``SymbolicTensor``) per tensor argument of the graphopt op (None for an
absent optional tensor) and the op's Python arguments as they are, and records ONNX nodes by
calling ``op.X(...)`` / ``ms.X(...)``. The values it receives carry the dtype and shape the FX
graph's fake tensors had, so a translation can choose a fused ORT op from static facts
(rank, head counts, whether two sequence lengths are the same symbol) at export time. Values
it creates itself carry no shape: decide from the inputs, never from intermediates.
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir
from onnxscript import opset18 as op  # standard ONNX ops (the exporter's base opset)
from onnxscript.values import Opset

from graphopt.backends.onnxruntime.lower.schemas import MS_DOMAIN, register_ort_schemas

register_ort_schemas()  # before any translation names an ORT op

# ONNX Runtime's contrib ops. (SimplifiedLayerNormalization lives in the default domain in
# ORT, so it is called as op.SimplifiedLayerNormalization.)
ms = Opset(MS_DOMAIN, 1)

__all__ = ["annotate", "cast_to", "const", "dims_equal", "ms", "ones_like_last_dim", "op", "promote", "rank",
           "same_shape", "static_dim"]


def rank(value: Any) -> int | None:
    return None if value is None or value.shape is None else len(value.shape)


def static_dim(value: Any, axis: int) -> int | None:
    """The size of ``axis`` when the export knows it as an int, else None."""
    if value is None or value.shape is None:
        return None
    dim = value.shape[axis]
    return dim if isinstance(dim, int) else None


def dims_equal(a: Any, b: Any) -> bool:
    """Whether two dims are provably the same: equal ints, or the same named symbol."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    name_a, name_b = getattr(a, "value", None), getattr(b, "value", None)
    return name_a is not None and name_a == name_b


def same_shape(a: Any, b: Any) -> bool:
    if a is None or b is None or a.shape is None or b.shape is None or len(a.shape) != len(b.shape):
        return False
    return all(dims_equal(x, y) for x, y in zip(a.shape, b.shape))


def ones_like_last_dim(x: Any) -> Any:
    """Ones of shape [H] in x's dtype (a constant when H is static): the scale of a norm
    without a weight, since the fused ops require one."""
    hidden = static_dim(x, -1)
    if hidden is None:
        return op.ConstantOfShape(op.Shape(x, start=-1), value=ir.tensor([1.0], dtype=x.dtype))
    return op.Constant(value=ir.tensor([1.0] * hidden, dtype=x.dtype))


def const(value: Any, dtype: ir.DataType) -> Any:
    """A typed constant. Python numbers given straight to an op take the dtype of the op's
    other inputs when the exporter knows it, which it does not for values made here."""
    return op.Constant(value=ir.tensor(value, dtype=dtype))


def annotate(value: Any, like: Any) -> Any:
    """Give a value this translation made the dtype and shape of ``like`` (for a value
    known to have them, such as a softmax of ``like``), so later helpers can read them."""
    value.dtype = like.dtype
    value.shape = ir.Shape(like.shape) if like.shape is not None else None
    return value


def cast_to(value: Any, dtype: ir.DataType) -> Any:
    return value if value.dtype == dtype else op.Cast(value, to=dtype)


def promote(*values: Any) -> ir.DataType:
    """torch's type promotion among floating dtypes (the wider one; bf16 with f16 -> f32)."""
    order = [ir.DataType.BFLOAT16, ir.DataType.FLOAT16, ir.DataType.FLOAT, ir.DataType.DOUBLE]
    dtypes = {v.dtype for v in values if v is not None}
    if dtypes == {ir.DataType.BFLOAT16, ir.DataType.FLOAT16}:
        return ir.DataType.FLOAT
    return max(dtypes, key=order.index)
