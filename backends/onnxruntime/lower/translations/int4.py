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

The 8-bit linear (an LM head) is lowered per row count: up to ``HEAD_GEMM_ROWS - 1`` rows
(decode) MatMulNBits bits=8, from ``HEAD_GEMM_ROWS`` rows on (a prefill that returns every
position's logits) dequantize-then-MatMul. MLAS has no fast 8-bit kernel for many rows here
(AVX2, no VNNI): MatMulNBits bits=8 measured 1.4-1.5x an fp32 MatMul at 128 rows of
llama-small's head (1024 x 32000), against 0.44x at one row. The dequantization is
Cast / Sub / Mul of constants, which ONNX Runtime folds at session load into an fp32 weight:
the GEMM then runs at fp32 speed, and the session holds that fp32 copy (N x K x 4 bytes; the
file holds only the 8-bit codes). With a static row count the choice is made at export;
with a dynamic one an ``If`` on the row count carries both branches. 4-bit linears keep
MatMulNBits at every row count: at 128 rows their level-4 kernel measured at fp32 MatMul's
speed on llama-small's four layer shapes, and an fp32 copy of every layer would undo INT4.

MatMulNBits needs a power-of-two block of at least 16; other group sizes (reachable
only by calling the op directly) raise UnsupportedOp, and the target falls back to eager.
"""

from __future__ import annotations

import onnx_ir as ir
import torch

from graphopt.backends.onnxruntime.errors import UnsupportedOp
from graphopt.backends.onnxruntime.lower.translations._common import cast_to, ms, op, static_dim

graphopt = torch.ops.graphopt

# 4 = int8 activations (MLAS's fast CPU path); 0 = compute in A's dtype. Tests set 0 to
# check that ORT multiplies by exactly the reference's dequantized weights.
ACCURACY_LEVEL = 4
# Rows from which an 8-bit linear is dequantize-then-MatMul (see the module docstring; at 16
# rows MatMulNBits bits=8 and fp32 MatMul measured about even). None: MatMulNBits always.
HEAD_GEMM_ROWS: int | None = 16


def _typed(codes, shape: list[int]):
    """The codes' Reshape with its type stated: uint8 in, uint8 out. Without it onnx-ir prints
    "The value type for shape [N, G, ...] is not known" for every packed weight each time the
    model is serialized."""
    codes.type, codes.shape = ir.TensorType(ir.DataType.UINT8), ir.Shape(shape)
    return codes


def int4_linear(x, packed, scales, zeros, group_size: int, bias=None):
    if group_size < 16 or group_size & (group_size - 1):
        raise UnsupportedOp("graphopt.int4_linear", f"MatMulNBits needs a power-of-two block >= 16, got {group_size}")
    n, groups, k = static_dim(scales, 0), static_dim(scales, 1), static_dim(x, -1)
    if n is None or groups is None or k is None:
        raise UnsupportedOp("graphopt.int4_linear", "MatMulNBits needs static N, K and group counts")
    b = _typed(op.Reshape(packed, op.Constant(value=ir.tensor([n, groups, group_size // 2], dtype=ir.DataType.INT64))),
               [n, groups, group_size // 2])
    inputs = [x, b, cast_to(scales, x.dtype), zeros, None, cast_to(bias, x.dtype) if bias is not None else None]
    while inputs[-1] is None:  # trailing optional inputs are left out, middle ones stay as ""
        inputs.pop()
    return ms.MatMulNBits(*inputs, K=k, N=n, bits=4, block_size=group_size, accuracy_level=ACCURACY_LEVEL)


def int8_linear(x, qweight, scales, group_size: int, bias=None):
    """``graphopt.int8_linear`` -> MatMulNBits with bits=8 (one code a byte, ``B`` viewed as
    [N, G, group_size], the implied zero point 128: graphopt/ops/quant.py) for few rows, a
    dequantize-then-MatMul for many (see the module docstring)."""
    if group_size < 16 or group_size & (group_size - 1):
        raise UnsupportedOp("graphopt.int8_linear", f"MatMulNBits needs a power-of-two block >= 16, got {group_size}")
    n, groups, k = static_dim(scales, 0), static_dim(scales, 1), static_dim(x, -1)
    if n is None or groups is None or k is None:
        raise UnsupportedOp("graphopt.int8_linear", "MatMulNBits needs static N, K and group counts")
    b = _typed(op.Reshape(qweight, op.Constant(value=ir.tensor([n, groups, group_size], dtype=ir.DataType.INT64))),
               [n, groups, group_size])
    scales, bias = cast_to(scales, x.dtype), cast_to(bias, x.dtype) if bias is not None else None

    def nbits(graph_op):
        inputs = [x, b, scales] + ([None, None, bias] if bias is not None else [])
        return graph_op("com.microsoft", "MatMulNBits", inputs, K=k, N=n, bits=8, block_size=group_size,
                        accuracy_level=ACCURACY_LEVEL)

    def gemm(graph_op):
        codes = graph_op("", "Cast", [b], to=x.dtype)
        centered = graph_op("", "Sub", [codes, graph_op.const(ir.tensor(128.0, dtype=x.dtype))])
        per_group = graph_op("", "Unsqueeze", [scales, graph_op.const(ir.tensor([2], dtype=ir.DataType.INT64))])
        weight = graph_op("", "Reshape", [graph_op("", "Mul", [centered, per_group]),
                                          graph_op.const(ir.tensor([n, groups * group_size], dtype=ir.DataType.INT64))])
        if groups * group_size != k:  # K padded up to whole groups: the padding's codes multiply nothing
            weight = graph_op("", "Slice", [weight, graph_op.const(ir.tensor([0], dtype=ir.DataType.INT64)),
                                            graph_op.const(ir.tensor([k], dtype=ir.DataType.INT64)),
                                            graph_op.const(ir.tensor([1], dtype=ir.DataType.INT64))])
        out = graph_op("", "MatMul", [x, graph_op("", "Transpose", [weight], perm=[1, 0])])
        return graph_op("", "Add", [out, bias]) if bias is not None else out

    rows = _static_rows(x)
    if HEAD_GEMM_ROWS is None or (rows is not None and rows < HEAD_GEMM_ROWS):
        return nbits(_TRACED)
    if rows is not None:
        return gemm(_TRACED)
    count = op.ReduceProd(op.Shape(x, end=-1), keepdims=0)
    many = op.GreaterOrEqual(count, op.Constant(value=ir.tensor(HEAD_GEMM_ROWS, dtype=ir.DataType.INT64)))
    return op.If(many, then_branch=_branch(gemm, "int8_linear_gemm"), else_branch=_branch(nbits, "int8_linear_nbits"))


def _static_rows(x) -> int | None:
    """The product of x's leading dims when all are ints, else None."""
    if x.shape is None or any(not isinstance(d, int) for d in x.shape[:-1]):
        return None
    rows = 1
    for d in x.shape[:-1]:
        rows *= d
    return rows


class _Traced:
    """Emits ops into the graph being traced (the translation's ordinary ``op`` / ``ms`` calls)."""

    def __call__(self, domain: str, op_type: str, inputs, **attrs):
        opset = ms if domain == "com.microsoft" else op
        return getattr(opset, op_type)(*inputs, **attrs)

    def const(self, tensor):
        return op.Constant(value=tensor)


class _SubgraphOps:
    """Emits ops as nodes of an ``If`` branch; the branch reads the outer graph's values by name."""

    def __init__(self) -> None:
        self.nodes: list[ir.Node] = []

    def __call__(self, domain: str, op_type: str, inputs, **attrs):
        node = ir.Node(domain, op_type, inputs, attributes=[ir.convenience.convert_attribute(k, v)
                                                            for k, v in attrs.items()], num_outputs=1)
        self.nodes.append(node)
        return node.outputs[0]

    def const(self, tensor):
        return self("", "Constant", [], value=tensor)


_TRACED = _Traced()


def _branch(build, name: str) -> ir.Graph:
    ops = _SubgraphOps()
    out = build(ops)
    return ir.Graph([], [out], nodes=ops.nodes, name=name)


TRANSLATIONS = {graphopt.int4_linear.default: int4_linear, graphopt.int8_linear.default: int8_linear}
