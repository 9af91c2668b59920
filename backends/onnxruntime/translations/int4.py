"""INT4 (and INT8) weight-only linear -> ONNX Runtime's ``MatMulNBits``:
``graphopt.int4_linear(x, packed, scales, zeros, group_size, bias)`` ->
``com.microsoft.MatMulNBits(x, Reshape(packed, [N, G, group_size / 2]), scales, zeros, bias,
K, N, bits=4, block_size=group_size, accuracy_level=ACCURACY_LEVEL)``.

graphopt's INT4 format is MatMulNBits' (graphopt/ops/quant.py): the packed codes are its
``B`` viewed as [N, G, group_size / 2], the zero points its packed uint8 ``zero_points``,
an absent zero point its default 8. So the weights pass through untouched; the Reshape of
a constant folds away at export. ``scales`` and ``bias`` must have A's dtype: fp16 scales
of an fp32 model are cast to fp32, exactly (the ONNX file then holds them as fp32).

``accuracy_level`` 4 lets ORT quantize the activations to int8 per block and run MLAS's
int8 kernels, about 2x an fp32 MatMul on this CPU for a 4096 x 4096 GEMV (level 0, fp32
compute, is slower than fp32 MatMul). It costs accuracy: a relative output error around
1e-2 against the reference op, where level 0 matches it to fp32 rounding.

MatMulNBits needs a power-of-two block of at least 16; other group sizes (reachable
only by calling the op directly) raise UnsupportedOp, and the target falls back to eager.
"""

from __future__ import annotations

import onnx_ir as ir
import torch

from graphopt.backends.onnxruntime.errors import UnsupportedOp
from graphopt.backends.onnxruntime.translations._common import cast_to, ms, op, static_dim

graphopt = torch.ops.graphopt

# 4 = int8 activations (MLAS's fast CPU path); 0 = compute in A's dtype. Tests set 0 to
# check that ORT multiplies by exactly the reference's dequantized weights.
ACCURACY_LEVEL = 4


def int4_linear(x, packed, scales, zeros, group_size: int, bias=None):
    if group_size < 16 or group_size & (group_size - 1):
        raise UnsupportedOp("graphopt.int4_linear", f"MatMulNBits needs a power-of-two block >= 16, got {group_size}")
    n, groups, k = static_dim(scales, 0), static_dim(scales, 1), static_dim(x, -1)
    if n is None or groups is None or k is None:
        raise UnsupportedOp("graphopt.int4_linear", "MatMulNBits needs static N, K and group counts")
    b = op.Reshape(packed, op.Constant(value=ir.tensor([n, groups, group_size // 2], dtype=ir.DataType.INT64)))
    inputs = [x, b, cast_to(scales, x.dtype), zeros, None, cast_to(bias, x.dtype) if bias is not None else None]
    while inputs[-1] is None:  # trailing optional inputs are left out, middle ones stay as ""
        inputs.pop()
    return ms.MatMulNBits(*inputs, K=k, N=n, bits=4, block_size=group_size, accuracy_level=ACCURACY_LEVEL)


def int8_linear(x, qweight, scales, group_size: int, bias=None):
    """``graphopt.int8_linear`` -> MatMulNBits with bits=8: one code a byte, ``B`` viewed as
    [N, G, group_size], the implied zero point 128 (graphopt/ops/quant.py)."""
    if group_size < 16 or group_size & (group_size - 1):
        raise UnsupportedOp("graphopt.int8_linear", f"MatMulNBits needs a power-of-two block >= 16, got {group_size}")
    n, groups, k = static_dim(scales, 0), static_dim(scales, 1), static_dim(x, -1)
    if n is None or groups is None or k is None:
        raise UnsupportedOp("graphopt.int8_linear", "MatMulNBits needs static N, K and group counts")
    b = op.Reshape(qweight, op.Constant(value=ir.tensor([n, groups, group_size], dtype=ir.DataType.INT64)))
    inputs = [x, b, cast_to(scales, x.dtype)] + ([None, None, cast_to(bias, x.dtype)] if bias is not None else [])
    return ms.MatMulNBits(*inputs, K=k, N=n, bits=8, block_size=group_size, accuracy_level=ACCURACY_LEVEL)


TRANSLATIONS = {graphopt.int4_linear.default: int4_linear, graphopt.int8_linear.default: int8_linear}
