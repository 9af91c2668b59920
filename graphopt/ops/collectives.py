"""Collective ops: a tensor-parallel all-reduce fused with the residual add and RMSNorm.

In a tensor-parallel Llama the row-parallel projections (o_proj, down_proj) end in an
all-reduce whose result is added to the residual stream and normalised by the next
RMSNorm. ``all_reduce_add_rms_norm`` is that chain as one op, so a target with a fused
kernel (vLLM's one-shot all-reduce + RMSNorm) can write the norm while the reduced rows
are still in registers. Its reference is exactly the unfused chain: torch.distributed's
functional all_reduce, wait_tensor, then ``graphopt.add_rms_norm``; so it runs wherever that
all_reduce runs. It has run on gloo (the CPU) only: graphopt's launcher starts gloo ranks, and
no NCCL or RCCL group has run it.

Not listed in ``graphopt.ops.OPS``: that table is the catalogue every single-device target
(ONNX Runtime, TensorRT) promises to lower, and none of them can run a collective; they run
this op's graphs eagerly instead (see the onnxruntime partitioner's off-target ops).
"""

from __future__ import annotations

import torch
from torch import Tensor

from graphopt.ops.norms import _norm_out_dtype, _rms_norm_ref

_c10d = torch.ops._c10d_functional

# graphopt ops that talk to other ranks: a single-device runtime cannot run them.
COLLECTIVE_OPS = ("graphopt.all_reduce_add_rms_norm",)


@torch.library.custom_op("graphopt::all_reduce_add_rms_norm", mutates_args=())
def all_reduce_add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, group_name: str,
    weight_offset: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """``s = all_reduce_sum(x, group) + residual``; returns ``(rms_norm(s), s)``."""
    reduced = _c10d.wait_tensor(_c10d.all_reduce(x, "sum", group_name))
    total = reduced + residual
    return _rms_norm_ref(total, weight, eps, weight_offset), total


@all_reduce_add_rms_norm.register_fake
def _(x, residual, weight, eps, group_name, weight_offset=0.0):
    total = torch.empty_like(x + residual)
    return total.new_empty(total.shape, dtype=_norm_out_dtype(total, weight)), total
