"""Merged projections: ``graphopt.qkv_proj(x, W, b, sizes)`` -> ``MatMul(x, W^T)`` (+ ``Add(b)``)
+ one ``Slice`` per projection.

The transpose of the frozen weight is a constant that ORT folds once at session creation,
so at run time this is one GEMM over the concatenated weights. Slices rather than ``Split``:
opset 18's Split takes its sizes as an input and then cannot also say how many outputs it
has, which the exporter needs to know when it records the node.
"""

from __future__ import annotations

import torch

from graphopt.backends.onnxruntime.lower.translations._common import cast_to, op, promote

graphopt = torch.ops.graphopt


def qkv_proj(x, weight, bias, sizes: list[int]):
    dtype = promote(x, weight, bias)
    fused = op.MatMul(cast_to(x, dtype), op.Transpose(cast_to(weight, dtype), perm=[1, 0]))
    if bias is not None:
        fused = op.Add(fused, cast_to(bias, dtype))
    outputs, start = [], 0
    for size in sizes:
        outputs.append(op.Slice(fused, [start], [start + size], [-1]))
        start += size
    return outputs


TRANSLATIONS = {graphopt.qkv_proj.default: qkv_proj}
