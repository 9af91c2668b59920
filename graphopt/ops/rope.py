"""Rotary position embedding."""

from __future__ import annotations

import torch
from torch import Tensor

from graphopt.ops._library import register


def rotate(x: Tensor, interleaved: bool) -> Tensor:
    """The rotation partner of each element: rotate-half or interleaved pairs."""
    if interleaved:
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((-odd, even), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """The reference of ``graphopt.rope`` (and of the rotations in ``graphopt.rope_kv_cache_update``)."""
    rot_dim = cos.shape[-1]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    out = x_rot * c + rotate(x_rot, interleaved) * s
    if x_pass.shape[-1]:
        out = torch.cat((out, x_pass), dim=-1)
    return out.to(torch.promote_types(x.dtype, cos.dtype)).contiguous()


@torch.library.custom_op("graphopt::rope", mutates_args=())
def rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """Rotary embedding of ``x`` [B, H, S, D] with ``cos``/``sin`` [B, S, R].

    The first R (even, <= D) channels rotate, the rest pass through (partial rotary).
    ``cos``/``sin`` hold one value per channel: duplicated halves for rotate-half
    (``cat([f, f])``), repeated pairs for interleaved (``repeat_interleave(f, 2)``).
    """
    return apply_rope(x, cos, sin, interleaved)


@rope.register_fake
def _(x, cos, sin, interleaved=False):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, cos.dtype))


register("rope")
