"""Mixture of experts with INT4 expert weights: ``graphopt.int4_moe``.

``graphopt.int4_moe(x, router_weight, gate_up, gate_up_scales, gate_up_zeros, down,
down_scales, down_zeros, group_size, k, normalize)`` is ``graphopt.moe(x, router_weight,
dequant(gate_up), dequant(down), k, normalize)``: the routed experts of ``graphopt.moe``
with each expert's weights in ``graphopt.int4_linear``'s format (graphopt/ops/quant.py,
which is MatMulNBits' and QMoE's ``weights_prepacked=0`` layout), stacked over experts:

- ``gate_up``: uint8 ``[E, 2 * inter, ceil(hidden / group_size) * group_size / 2]``, gate
  rows first (as ``graphopt.moe``); ``gate_up_scales`` ``[E, 2 * inter, G_hidden]``;
  ``gate_up_zeros`` None (symmetric, zero point 8) or uint8 ``[E, 2 * inter, ceil(G_hidden / 2)]``;
- ``down``: uint8 ``[E, hidden, G_inter * group_size / 2]``, ``down_scales`` ``[E, hidden,
  G_inter]``, ``down_zeros`` likewise.

A shared expert is no part of the op: the quantizer writes it as ``graphopt.int4_linear``
GEMMs beside it (it is a dense MLP every token runs). Why a separate op and not
``graphopt.moe`` with more arguments: the routed experts' bytes are what decoding reads,
and a kernel (ONNX Runtime's ``QMoE``) reads the 4-bit codes only when the graph hands it
the codes, not a dequantized copy.

The reference dequantizes every expert and runs ``graphopt.moe``'s reference (dense: every
expert on every token, weighted by the routing); it is what a target without an INT4 MoE
kernel runs, eagerly or decomposed into its ATen ops.
"""

from __future__ import annotations

import torch
from torch import Tensor

from graphopt.ops import moe as dense
from graphopt.ops._library import reference_of, register
from graphopt.ops.quant import SYMMETRIC_ZERO, check_format


def _expert_format(name: str, packed: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int,
                   experts: int, rows: int, in_features: int) -> None:
    lead = (experts, rows)
    if packed.dim() != 3 or scales.dim() != 3 or packed.shape[:2] != lead or scales.shape[:2] != lead:
        raise ValueError(f"int4_moe: {name} must be [{experts}, {rows}, K/2] codes with [{experts}, {rows}, G] scales, "
                         f"got {tuple(packed.shape)} and {tuple(scales.shape)}")
    if zeros is not None and (zeros.dim() != 3 or zeros.shape[:2] != (experts, rows)):
        raise ValueError(f"int4_moe: {name} zero points must be [{experts}, {rows}, ceil(G / 2)], "
                         f"got {tuple(zeros.shape)}")
    check_format(packed[0], scales[0], zeros[0] if zeros is not None else None, group_size, in_features)


def _check(x: Tensor, router_weight: Tensor, gate_up, gate_up_scales, gate_up_zeros, down, down_scales, down_zeros,
           group_size: int, k: int) -> int:
    """Validate the op's tensors (one-line errors); return the experts' inter size."""
    experts, hidden = router_weight.shape
    if x.dim() != 2 or x.shape[-1] != hidden:
        raise ValueError(f"int4_moe: x must be [tokens, {hidden}], got {tuple(x.shape)}")
    if gate_up_scales.dim() != 3 or gate_up_scales.shape[1] % 2:
        raise ValueError(f"int4_moe: gate_up_scales must be [{experts}, 2 * inter, G], "
                         f"got {tuple(gate_up_scales.shape)}")
    inter = gate_up_scales.shape[1] // 2
    _expert_format("gate_up", gate_up, gate_up_scales, gate_up_zeros, group_size, experts, 2 * inter, hidden)
    _expert_format("down", down, down_scales, down_zeros, group_size, experts, hidden, inter)
    if not 1 <= k <= experts:
        raise ValueError(f"int4_moe: k={k} must be between 1 and the number of experts ({experts})")
    return inter


def _nibbles(packed: Tensor) -> Tensor:
    """float32 codes ``[..., 2 * C]`` of uint8 ``[..., C]`` (low nibble first), in float
    arithmetic, which is exact here: torch.onnx exports ``>>`` on uint8 with an int8 result
    that ORT refuses, and the decomposed op must export."""
    byte = packed.float()
    high = torch.floor(byte / 16)
    return torch.stack((byte - 16 * high, high), dim=-1).flatten(-2)


def dequantize_experts(packed: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int,
                       in_features: int) -> Tensor:
    """float32 ``[E, N, in_features]`` of stacked INT4 expert weights ``[E, N, K_pad / 2]``:
    ``(q - z) * s`` per group, as graphopt.ops.quant.dequantize_int4 for each expert."""
    experts, rows, groups = scales.shape
    codes = _nibbles(packed).reshape(experts, rows, groups, group_size)
    if zeros is not None:
        zero = _nibbles(zeros)[..., :groups]
    else:
        zero = torch.full_like(scales, SYMMETRIC_ZERO, dtype=torch.float32)
    weight = (codes - zero.unsqueeze(-1)) * scales.float().unsqueeze(-1)
    return weight.reshape(experts, rows, groups * group_size)[..., :in_features]


@torch.library.custom_op("graphopt::int4_moe", mutates_args=())
def int4_moe(x: Tensor, router_weight: Tensor, gate_up: Tensor, gate_up_scales: Tensor, gate_up_zeros: Tensor | None,
             down: Tensor, down_scales: Tensor, down_zeros: Tensor | None, group_size: int, k: int,
             normalize: bool) -> Tensor:
    """``graphopt.moe`` of the dequantized experts (module docstring)."""
    inter = _check(x, router_weight, gate_up, gate_up_scales, gate_up_zeros, down, down_scales, down_zeros,
                   group_size, k)
    w1 = dequantize_experts(gate_up, gate_up_scales, gate_up_zeros, group_size, x.shape[-1]).to(x.dtype)
    w2 = dequantize_experts(down, down_scales, down_zeros, group_size, inter).to(x.dtype)
    # graphopt.moe's reference, not the op: decomposing this op then leaves plain ATen ops
    # (a target that lowers no graphopt op, TensorRT, needs exactly that).
    return reference_of(torch.ops.graphopt.moe.default)(x, router_weight, w1, w2, k, normalize)


def int4_moe_sparse(x: Tensor, router_weight: Tensor, gate_up: Tensor, gate_up_scales: Tensor,
                    gate_up_zeros: Tensor | None, down: Tensor, down_scales: Tensor, down_zeros: Tensor | None,
                    group_size: int, k: int, normalize: bool) -> Tensor:
    """``graphopt.int4_moe`` for an eager run: each expert a token was routed to is
    dequantized and run on its own tokens, so a decode step unpacks k experts, not all."""
    if dense.capturing(x):
        return int4_moe(x, router_weight, gate_up, gate_up_scales, gate_up_zeros, down, down_scales, down_zeros,
                        group_size, k, normalize)
    inter = _check(x, router_weight, gate_up, gate_up_scales, gate_up_zeros, down, down_scales, down_zeros,
                   group_size, k)
    weights, experts = dense.route(x, router_weight, k, normalize)
    if dense._recording:
        dense._recording[-1].add(router_weight, experts)

    def one(packed, scales, zeros, e, in_features):
        z = zeros[e:e + 1] if zeros is not None else None
        return dequantize_experts(packed[e:e + 1], scales[e:e + 1], z, group_size, in_features)[0].to(x.dtype)

    def expert_mlp(e: int, rows: Tensor) -> Tensor:
        w1 = one(gate_up, gate_up_scales, gate_up_zeros, e, x.shape[-1])
        w2 = one(down, down_scales, down_zeros, e, inter)
        return dense._swiglu_mlp(rows, w1, w2)

    return dense.dispatch_routed(x, weights, experts, router_weight.shape[0], expert_mlp)


@int4_moe.register_fake
def _(x, router_weight, gate_up, gate_up_scales, gate_up_zeros, down, down_scales, down_zeros, group_size, k,
      normalize):
    _check(x, router_weight, gate_up, gate_up_scales, gate_up_zeros, down, down_scales, down_zeros, group_size, k)
    return x.new_empty(x.shape)


register("int4_moe")
