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

``graphopt.int4_moe`` (INT4 experts, graphopt/ops/moe_int4.py) -> ``com.microsoft.QMoE``
with ``expert_weight_bits=4, weights_prepacked=0, block_size=group_size``: the raw
[E, N, K / 2] codes, [E, N, G] scales and packed zero points are MatMulNBits' layout per
expert, which is graphopt's INT4 format, so only the gate/up rows are interleaved (codes,
scales and zero points alike: rows are independent). What the CPU kernel of onnxruntime
1.32 was checked to run, against the dequantized reference: 4 and 8 bits, block-wise and
per-row scales, with and without zero points, fp16 scales beside fp32 activations, and
interleaved SwiGLU only (``swiglu_fusion=2`` fails at session creation). Its
``normalize_routing_weights=0`` is ignored (the k weights are always renormalised, checked
against the reference): for Qwen2-MoE's softmax weights the translation passes the
softmax as ``router_weights``, whose values at the chosen experts the kernel mixes with
unchanged (``router_probs`` then only picks the experts).
``accuracy_level`` is MatMulNBits' (translations/int4.py): at 4, block-wise 4-bit experts
run on int8 activations. QMoE needs hidden and inter sizes divisible by the block; where
they are not, the translation refuses with that reason and the partitioner decomposes the
op into its reference's ATen ops (dequantize, then every expert densely on every token),
which still run on ONNX Runtime; the report lists the op as decomposed with that reason.
"""

from __future__ import annotations

import onnx_ir as ir
import torch

from graphopt.backends.onnxruntime.errors import UnsupportedOp
from graphopt.backends.onnxruntime.lower.translations import int4 as _int4
from graphopt.backends.onnxruntime.lower.translations._common import cast_to, ms, op, static_dim

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


def int4_moe(x, router_weight, gate_up, gate_up_scales, gate_up_zeros, down, down_scales, down_zeros,
             group_size: int, k: int, normalize: bool):
    name = "graphopt.int4_moe"
    if x.dtype not in _KERNEL_DTYPES or router_weight.dtype != x.dtype:
        raise UnsupportedOp(name, "ORT's QMoE kernel needs x and the router weight in one of float, float16, bfloat16")
    hidden, inter = static_dim(x, -1), static_dim(gate_up_scales, 1)
    if hidden is None or inter is None:
        raise UnsupportedOp(name, "QMoE needs static hidden and inter sizes")
    inter //= 2
    if group_size < 16 or group_size & (group_size - 1):
        raise UnsupportedOp(name, f"QMoE needs a power-of-two block >= 16, got {group_size}")
    if hidden % group_size or inter % group_size:
        raise UnsupportedOp(name, f"ORT's QMoE kernel lacks padded blocks: hidden {hidden} and inter {inter} must be "
                                  f"multiples of group_size {group_size}")
    logits = _linear(x, router_weight)
    inputs = [x, logits, _interleaved(gate_up), cast_to(_interleaved(gate_up_scales), x.dtype), None,
              down, cast_to(down_scales, x.dtype), None, None, None, None,
              _interleaved(gate_up_zeros) if gate_up_zeros is not None else None, down_zeros, None,
              # the CPU kernel renormalises the top k whatever normalize_routing_weights says; given
              # router_weights it mixes with their values at the chosen experts, as they are
              None if normalize else op.Softmax(logits, axis=-1)]
    while inputs[-1] is None:  # trailing optional inputs are left out, middle ones stay as ""
        inputs.pop()
    return ms.QMoE(*inputs, k=k, activation_type="swiglu", swiglu_fusion=1, normalize_routing_weights=int(normalize),
                   activation_alpha=1.0, activation_beta=0.0, expert_weight_bits=4, weights_prepacked=0,
                   block_size=group_size, accuracy_level=_int4.ACCURACY_LEVEL)


TRANSLATIONS = {graphopt.moe.default: moe, graphopt.int4_moe.default: int4_moe}
