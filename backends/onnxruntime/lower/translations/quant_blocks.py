"""A checkpoint's block-quantized weights (graphopt/ops/quant_blocks.py) -> ONNX Runtime:

``graphopt.quantized_linear(x, codes, scales, zeros, offsets, bits, group_size, bias)`` ->
``com.microsoft.MatMulNBits(x, codes, scales, zeros, bias, K, N, bits, block_size, accuracy_level)``,
plus, with offsets, ``FusedMatMul(ReduceSum(Reshape(x, [..., G, group_size]), -1), offsets, transB=1)``
added to it: ``sum_k x_k (s q_k + o) = s * sum_k x_k q_k + o * sum_k x_k`` per block.

``graphopt.quantized_gather(codes, scales, zeros, offsets, ids, bits, group_size, dtype)`` ->
``com.microsoft.GatherBlockQuantized`` for symmetric tables (no zero points, no offsets): the
codes are its ``data`` as they are ([V, G, group_size * bits / 8], uint8), the scales
unsqueezed to [V, G, 1] (the kernel wants the data's rank). A table with zero points or offsets
(Q4_1, Q4_K) is a Gather of its rows and their dequantization in standard ops, which is cheap
for the few rows a step reads.

The format is MatMulNBits' own, so every tensor passes through untouched: no Reshape or Cast of
a weight is left for the exporter or ORT to fold into a copy. The offsets' product is a
FusedMatMul with ``transB`` rather than a MatMul of ``Transpose(offsets)`` for the same reason.
``accuracy_level`` is MatMulNBits' (translations/int4.py): 4 quantizes the activations to int8
per block, MLAS's fast CPU path.
"""

from __future__ import annotations

import onnx_ir as ir
import torch

from graphopt.backends.onnxruntime.errors import UnsupportedOp
from graphopt.backends.onnxruntime.lower.translations import int4 as _int4
from graphopt.backends.onnxruntime.lower.translations._common import cast_to, ms, op, rank, static_dim

graphopt = torch.ops.graphopt
_OUT_DTYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16)


def _ints(values) -> object:
    return op.Constant(value=ir.tensor(list(values), dtype=ir.DataType.INT64))


def quantized_linear(x, codes, scales, zeros, offsets, bits: int, group_size: int, bias=None):
    name = "graphopt.quantized_linear"
    if group_size < 16 or group_size & (group_size - 1):
        raise UnsupportedOp(name, f"MatMulNBits needs a power-of-two block >= 16, got {group_size}")
    n, groups, k = static_dim(scales, 0), static_dim(scales, 1), static_dim(x, -1)
    if n is None or groups is None or k is None:
        raise UnsupportedOp(name, "MatMulNBits needs static N, K and block counts")
    inputs = [x, codes, cast_to(scales, x.dtype), zeros, None, cast_to(bias, x.dtype) if bias is not None else None]
    while inputs[-1] is None:  # trailing optional inputs are left out, middle ones stay as ""
        inputs.pop()
    out = ms.MatMulNBits(*inputs, K=k, N=n, bits=bits, block_size=group_size, accuracy_level=_int4.ACCURACY_LEVEL)
    if offsets is None:
        return out
    sums = op.ReduceSum(_as_blocks(x, groups, group_size), _ints([-1]), keepdims=0)
    return op.Add(out, ms.FusedMatMul(sums, cast_to(offsets, x.dtype), transB=1))


def _as_blocks(x, groups: int, group_size: int):
    """x [..., K] as [..., groups, group_size]. With x's rank known, the target shape is a
    constant (a 0 keeps that dim): a decode step then runs one Reshape per quantized linear
    with offsets, not Shape + Concat + Reshape on every token."""
    known = rank(x)
    if known is None:
        return op.Reshape(x, op.Concat(op.Shape(x, end=-1), _ints([groups, group_size]), axis=0))
    blocks = op.Reshape(x, _ints([0] * (known - 1) + [groups, group_size]))
    # The exporter works out this value's shape from the constant but not its dtype, and
    # onnx_ir then warns once per linear that it skips its value_info: say the dtype.
    blocks.dtype = x.dtype
    return blocks


def quantized_gather(codes, scales, zeros, offsets, ids, bits: int, group_size: int, dtype: ir.DataType):
    name = "graphopt.quantized_gather"
    if dtype not in _OUT_DTYPES:
        raise UnsupportedOp(name, f"ONNX Runtime's CPU kernels write float32 or float16 rows, not {dtype.name}")
    groups = static_dim(scales, 1)
    if groups is None:
        raise UnsupportedOp(name, "a quantized table needs a static size")
    width = _ints([groups * group_size])
    if zeros is None and offsets is None and group_size >= 16 and not group_size & (group_size - 1):
        per_block = op.Unsqueeze(cast_to(scales, dtype), _ints([2]))
        rows = ms.GatherBlockQuantized(codes, ids, per_block, gather_axis=0, quantize_axis=2, block_size=group_size,
                                       bits=bits)
        return op.Reshape(rows, op.Concat(op.Shape(ids), width, axis=0))
    # Zero points or offsets (Q4_1, Q4_K tables), which GatherBlockQuantized cannot take: the
    # picked rows are dequantized in standard ops, cheap for the few rows a step reads.
    q = _unpacked(op.Gather(codes, ids, axis=0), bits)  # [..., G, group]
    z = (op.Unsqueeze(_unpacked(op.Gather(zeros, ids, axis=0), bits, groups), _ints([-1])) if zeros is not None
         else op.Constant(value=ir.tensor(float(1 << (bits - 1)), dtype=ir.DataType.FLOAT)))
    rows = op.Mul(op.Sub(q, z), op.Unsqueeze(op.Gather(cast_to(scales, ir.DataType.FLOAT), ids, axis=0), _ints([-1])))
    if offsets is not None:
        rows = op.Add(rows, op.Unsqueeze(op.Gather(cast_to(offsets, ir.DataType.FLOAT), ids, axis=0), _ints([-1])))
    rows = op.Reshape(rows, op.Concat(op.Shape(ids), width, axis=0))
    return rows if dtype == ir.DataType.FLOAT else op.Cast(rows, to=dtype)


def _unpacked(packed, bits: int, keep: int | None = None):
    """uint8 codes -> float32, one value per code: 4-bit ones split into (low, high) nibbles
    along the last axis, and cut to ``keep`` values (zero points padded to whole bytes)."""
    if bits == 4:
        low = op.BitwiseAnd(packed, op.Constant(value=ir.tensor(15, dtype=ir.DataType.UINT8)))
        high = op.BitShift(packed, op.Constant(value=ir.tensor(4, dtype=ir.DataType.UINT8)), direction="RIGHT")
        both = op.Concat(op.Unsqueeze(low, _ints([-1])), op.Unsqueeze(high, _ints([-1])), axis=-1)
        packed = op.Reshape(both, op.Concat(op.Shape(packed, end=-1), _ints([-1]), axis=0))
        if keep is not None:
            packed = op.Slice(packed, _ints([0]), _ints([keep]), _ints([-1]))
    return op.Cast(packed, to=ir.DataType.FLOAT)


TRANSLATIONS = {graphopt.quantized_linear.default: quantized_linear,
                graphopt.quantized_gather.default: quantized_gather}
