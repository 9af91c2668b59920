"""Rotary embedding fused with a step's KV-cache writes:
``graphopt.rope_kv_cache_update(q, k, v, cos, sin, k_cache, v_cache, pos, layout, interleaved)``.

It is, in one op, what a static-cache attention layer does between its projections and its
attention: ``kv_cache_update(k_cache, rope(k), pos)``, ``kv_cache_update(v_cache, v, pos)``
and returns ``rope(q)``. A decode step runs it once per layer where it ran four ops (two
rotations, two writes): on the GPU that is one kernel launch instead of four, and the
rotated keys go from registers to the cache without a round trip through memory. Only
``passes/fuse_rope_kv_cache_update.py`` creates it, after ``static_kv_cache``; like
``kv_cache_update`` it writes its two caches in place (passes/README.md says why that is safe).

Layouts ``bhsd`` and ``bshd`` (graphopt/ops/kv_cache.py); paged and int8 caches keep the
separate ops. The rotated keys are rounded to ``rope``'s output dtype, then to the cache's,
exactly as the two ops did.
"""

from __future__ import annotations

import torch
from torch import Tensor

from graphopt.ops._library import register
from graphopt.ops.kv_cache import check_update, write_update
from graphopt.ops.rope import apply_rope

LAYOUTS = ("bhsd", "bshd")


def check_rope_update(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor,
                      layout: str) -> None:
    """Raise ValueError, one line, when the arguments do not describe one fused update."""
    if layout not in LAYOUTS:
        raise ValueError(f"rope_kv_cache_update layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    check_update(k_cache, k, pos, layout, None, None)
    check_update(v_cache, v, pos, layout, None, None)
    if q.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"rope_kv_cache_update q {tuple(q.shape)} and k {tuple(k.shape)} must agree on "
                         "batch, tokens and head dim")
    if v.shape[2] != k.shape[2]:
        raise ValueError(f"rope_kv_cache_update k {tuple(k.shape)} and v {tuple(v.shape)} hold different tokens")


@torch.library.custom_op("graphopt::rope_kv_cache_update", mutates_args=("k_cache", "v_cache"))
def rope_kv_cache_update(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor,
                         v_cache: Tensor, pos: Tensor, layout: str = "bhsd", interleaved: bool = False) -> Tensor:
    """Write ``rope(k)`` and ``v`` [B, Hkv, S_new, D] into the caches at ``pos ..`` and return ``rope(q)``.

    ``q`` is [B, Hq, S_new, D]; ``cos``/``sin`` are [B or 1, S_new, R] as for ``graphopt.rope``.
    """
    check_rope_update(q, k, v, cos, k_cache, v_cache, pos, layout)
    write_update(k_cache, apply_rope(k, cos, sin, interleaved), pos, layout)
    write_update(v_cache, v, pos, layout)
    return apply_rope(q, cos, sin, interleaved)


@rope_kv_cache_update.register_fake
def _(q, k, v, cos, sin, k_cache, v_cache, pos, layout="bhsd", interleaved=False):
    check_rope_update(q, k, v, cos, k_cache, v_cache, pos, layout)
    return q.new_empty(q.shape, dtype=torch.promote_types(q.dtype, cos.dtype))


register("rope_kv_cache_update")
