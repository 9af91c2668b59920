"""Mixture of experts -> ONNX Runtime's ``com.microsoft.MoE`` (+ the shared expert as MatMuls).

``graphopt.moe(x, Wr, gate_up, down, k, normalize, Wsgu, Wsd, Wsg)`` ->
``MoE(x, x @ Wr^T, interleave(gate_up), None, down; k, activation_type="swiglu",
swiglu_fusion=1, normalize_routing_weights)``, then ``+ [Sigmoid(x @ Wsg^T) *]
swiglu(x @ Wsgu^T) @ Wsd^T`` for a shared expert (MoE has no input for one).

ORT's MoE takes the router *logits* and applies the softmax and top-k itself; with
``normalize_routing_weights`` it divides the k weights by their sum, as Mixtral does, and
without it keeps softmax's values, as Qwen2-MoE does. Its SwiGLU is
``g * sigmoid(alpha * g) * (u + beta)`` (defaults alpha 1, beta 0: plain SwiGLU).

The CPU kernel (checked on onnxruntime 1.32) only accepts the gate/up rows interleaved
(``swiglu_fusion=1``: g0, u0, g1, u1, ...), not concatenated ([g | u], ``swiglu_fusion=2``):
the translation interleaves the frozen weight with Reshape/Transpose, which ORT folds once
at session creation. The kernel takes float, float16 and bfloat16 inputs of the same type
for x and weights; anything else is refused here with its reason, so the partitioner runs
that op eagerly and keeps the rest of the graph on ORT.
"""

from __future__ import annotations

import onnx_ir as ir
import torch

from graphopt.backends.onnxruntime.errors import UnsupportedOp
from graphopt.backends.onnxruntime.translations._common import ms, op, static_dim

graphopt = torch.ops.graphopt

_KERNEL_DTYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _interleaved(gate_up):
    """[E, 2I, H] with gate rows then up rows -> [E, 2I, H] with g0, u0, g1, u1, ..."""
    experts, width, hidden = (static_dim(gate_up, i) for i in range(3))
    if None in (experts, width, hidden):
        raise UnsupportedOp("graphopt.moe", "expert weights need static shapes for MoE's interleaved layout")
    halves = op.Reshape(gate_up, op.Constant(value_ints=[experts, 2, width // 2, hidden]))
    return op.Reshape(op.Transpose(halves, perm=[0, 2, 1, 3]), op.Constant(value_ints=[experts, width, hidden]))


def _linear(x, weight):
    return op.MatMul(x, op.Transpose(weight, perm=[1, 0]))


def moe(x, router_weight, gate_up, down, k: int, normalize: bool,
        shared_gate_up=None, shared_down=None, shared_gate=None):
    tensors = [t for t in (x, router_weight, gate_up, down, shared_gate_up, shared_down, shared_gate) if t is not None]
    if x.dtype not in _KERNEL_DTYPES or any(t.dtype != x.dtype for t in tensors):
        raise UnsupportedOp("graphopt.moe", "ORT's MoE kernel needs x and every expert weight in one of float, "
                            "float16, bfloat16")
    out = ms.MoE(x, _linear(x, router_weight), _interleaved(gate_up), None, down,
                 k=k, activation_type="swiglu", swiglu_fusion=1, normalize_routing_weights=int(normalize),
                 activation_alpha=1.0, activation_beta=0.0)
    if shared_gate_up is None:
        return out
    gate, up = op.Split(_linear(x, shared_gate_up), axis=-1, num_outputs=2)
    shared = _linear(op.Mul(op.Mul(gate, op.Sigmoid(gate)), up), shared_down)
    if shared_gate is not None:
        shared = op.Mul(op.Sigmoid(_linear(x, shared_gate)), shared)
    return op.Add(out, shared)


TRANSLATIONS = {graphopt.moe.default: moe}
