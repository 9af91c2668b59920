"""Quantized embedding -> ONNX Runtime's ``GatherBlockQuantized``:
``graphopt.quantized_embedding(codes, scales, ids, bits, group_size, hidden, dtype)`` ->
``Reshape(com.microsoft.GatherBlockQuantized(Reshape(codes, [V, G, group_size * bits / 8]), ids,
Reshape(scales, [V, G, 1]), gather_axis=0, quantize_axis=2, block_size=group_size, bits=bits),
[*ids.shape, G * group_size])`` (then a Slice to ``hidden`` when the last group is padded).

Layout (checked on onnxruntime 1.32's CPU kernel): uint8 ``data`` holds two 4-bit codes a
byte, element 2j in the low nibble, or one 8-bit code a byte; with no ``zero_points`` the
zero point is 2^(bits-1) (8 / 128), as in MatMulNBits. The CPU kernel takes uint8 data only
with ``gather_axis`` 0 and ``quantize_axis`` the last axis; ``scales`` must have the data's
rank, and its dtype is the output's (float32 or float16 on the CPU: no bfloat16).

Why rank 3: ``[V, G, group_size * bits / 8]`` is byte for byte MatMulNBits' ``B`` for an
[N=V, K=hidden] weight, and the same Reshape of the same codes as ``int4.py``'s. When the
table is tied to an LM head (one set of codes in the FX graph), measured on this exporter:
a table over its 8192-element folding limit (any real vocabulary) keeps one codes
initializer, and common-subexpression elimination merges the two Reshapes into one node
that both ops read; a smaller one is folded into two identical initializers (a copy).
The scales cannot be one tensor for both: MatMulNBits' kernel checks them to be exactly
[N, G] or [N * G] and GatherBlockQuantized wants the data's rank, [V, G, 1]; over the limit
the file still holds them once, behind a Reshape that ONNX Runtime folds at load (a
session-time copy of the scales only: 1/8 of the 8-bit codes' bytes with fp32 scales).

Configurations the kernel cannot take raise UnsupportedOp with the reason, and the target
decomposes the op into its reference (an index_select and a dequantization in standard ops).
"""

from __future__ import annotations

import onnx_ir as ir
import torch

from graphopt.backends.onnxruntime.errors import UnsupportedOp
from graphopt.backends.onnxruntime.lower.translations._common import cast_to, ms, op, static_dim

graphopt = torch.ops.graphopt
# torch.onnx hands a dtype argument over as an ONNX data type.
_OUT_DTYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16)
NAME = "graphopt.quantized_embedding"


def _ints(values) -> object:
    return op.Constant(value=ir.tensor(list(values), dtype=ir.DataType.INT64))


def quantized_embedding(codes, scales, ids, bits: int, group_size: int, hidden: int, dtype: ir.DataType):
    if group_size < 16 or group_size & (group_size - 1):
        raise UnsupportedOp(NAME, f"GatherBlockQuantized needs a power-of-two block >= 16, got {group_size}")
    if dtype not in _OUT_DTYPES:
        raise UnsupportedOp(NAME, f"GatherBlockQuantized's CPU kernel writes float32 or float16, not {dtype.name}")
    vocab, groups = static_dim(scales, 0), static_dim(scales, 1)
    if vocab is None or groups is None:
        raise UnsupportedOp(NAME, "GatherBlockQuantized needs a static table size")
    data = op.Reshape(codes, _ints([vocab, groups, group_size * bits // 8]))
    per_block = op.Reshape(cast_to(scales, dtype), _ints([vocab, groups, 1]))
    rows = ms.GatherBlockQuantized(data, ids, per_block, gather_axis=0, quantize_axis=2, block_size=group_size,
                                   bits=bits)
    width = groups * group_size
    table = op.Reshape(rows, op.Concat(op.Shape(ids), _ints([width]), axis=0))
    if width != hidden:  # the last group is padded with zero codes: drop the padding
        table = op.Slice(table, _ints([0]), _ints([hidden]), _ints([-1]))
    return table


TRANSLATIONS = {graphopt.quantized_embedding.default: quantized_embedding}
