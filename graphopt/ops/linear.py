"""Linear-projection ops: several projections of one input as one GEMM."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from graphopt.ops._library import register


def _check_sizes(weight: Tensor, sizes: list[int]) -> None:
    if sum(sizes) != weight.shape[0]:
        raise ValueError(f"qkv_proj sizes {list(sizes)} do not add up to the weight's {weight.shape[0]} rows")


@torch.library.custom_op("graphopt::qkv_proj", mutates_args=())
def qkv_proj(x: Tensor, weight: Tensor, bias: Tensor | None, sizes: list[int]) -> list[Tensor]:
    """``F.linear(x, weight, bias).split(sizes, -1)``: q, k, v (and any further projections of
    the same input) from one GEMM over their row-concatenated weights.

    ``x`` is [..., K], ``weight`` [sum(sizes), K] (nn.Linear layout), ``bias`` [sum(sizes)] or
    None. Each output is [..., sizes[i]], a contiguous tensor of its own (custom-op outputs
    must not alias each other). Widths may differ: grouped-query attention has narrower k, v.
    """
    _check_sizes(weight, sizes)
    fused = F.linear(x, weight, bias)
    return [part.clone(memory_format=torch.contiguous_format) for part in fused.split(list(sizes), dim=-1)]


@qkv_proj.register_fake
def _(x, weight, bias, sizes):
    _check_sizes(weight, sizes)
    return [x.new_empty((*x.shape[:-1], n)) for n in sizes]


register("qkv_proj")
