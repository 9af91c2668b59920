"""Activation ops: gated MLPs (SwiGLU, GeGLU) and GELU with its bias add."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from graphopt.ops._library import register


def _halves(gate_up: Tensor) -> tuple[Tensor, Tensor]:
    half = gate_up.shape[-1] // 2
    return gate_up[..., :half], gate_up[..., half:]


def _half_width(gate_up: Tensor) -> Tensor:
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gated activation needs an even last dim, got {gate_up.shape[-1]}")
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.custom_op("graphopt::swiglu", mutates_args=())
def swiglu(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` where ``gate_up = cat([gate, up], -1)`` (one merged GEMM's output)."""
    gate, up = _halves(gate_up)
    return F.silu(gate) * up


@swiglu.register_fake
def _(gate_up):
    return _half_width(gate_up)


@torch.library.custom_op("graphopt::geglu", mutates_args=())
def geglu(gate_up: Tensor, approximate: str = "none") -> Tensor:
    """``gelu(gate, approximate) * up`` where ``gate_up = cat([gate, up], -1)``."""
    gate, up = _halves(gate_up)
    return F.gelu(gate, approximate=approximate) * up


@geglu.register_fake
def _(gate_up, approximate="none"):
    return _half_width(gate_up)


@torch.library.custom_op("graphopt::bias_gelu", mutates_args=())
def bias_gelu(x: Tensor, bias: Tensor | None, approximate: str = "none") -> Tensor:
    """``gelu(x + bias)``; ``approximate`` is ``"none"`` (erf) or ``"tanh"``."""
    return F.gelu(x if bias is None else x + bias, approximate=approximate)


@bias_gelu.register_fake
def _(x, bias, approximate="none"):
    return torch.empty_like(x if bias is None else x + bias)


for _name in ("swiglu", "geglu", "bias_gelu"):
    register(_name)
