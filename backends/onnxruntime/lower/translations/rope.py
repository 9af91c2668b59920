"""Rotary embedding: ``graphopt.rope(x, cos, sin, interleaved)`` -> ``com.microsoft.RotaryEmbedding``.

The interfaces differ: our op takes full-width tables per position, ``cos``/``sin`` of shape
[B, S, R] (each frequency twice: ``cat([f, f])`` for rotate-half, ``repeat_interleave(f, 2)``
for interleaved), while ORT's op takes a cache of half-width rows, ``cos_cache`` [P, R/2],
and ``position_ids`` [B, S] that pick a row per token. We rebuild that interface exactly
instead of assuming positions: the half-width tables, flattened to [B*S, R/2], are the cache,
and ``position_ids = arange(B*S).view(B, S)`` points every token at its own row. So any
positions work (offsets, per-row positions, scaled rotary), at the cost of a Slice and a
Reshape of the [B, S, R] tables, which the q and k ropes of a layer share after CSE.

ORT rotates the first ``rotary_embedding_dim`` channels and passes the rest through, which
is our partial rotary. x stays in [B, H, S, D] (ORT takes 4-D BNSH input). Tables of a
dtype other than x's are cast to the promoted dtype, as the reference computes in it.
"""

from __future__ import annotations

import onnx_ir as ir
import torch

from graphopt.backends.onnxruntime.errors import UnsupportedOp
from graphopt.backends.onnxruntime.lower.translations._common import cast_to, const, ms, op, promote, rank, static_dim

graphopt = torch.ops.graphopt
INT64 = ir.DataType.INT64


def _half_table(table, rot_dim: int, interleaved: bool):
    """[B, S, R] -> [B*S, R/2]: one value per rotated pair."""
    if interleaved:
        half = op.Slice(table, [0], [rot_dim], [-1], [2])
    else:
        half = op.Slice(table, [0], [rot_dim // 2], [-1])
    return op.Reshape(half, [-1, rot_dim // 2])


def rope(x, cos, sin, interleaved: bool = False):
    rot_dim = static_dim(cos, -1)
    if rank(x) != 4 or rank(cos) != 3 or rot_dim is None:
        # The op's contract (x [B, H, S, D], tables [B, S, R]) makes this unreachable from the
        # passes; a hand-built graph that breaks it falls back to eager, reported.
        raise UnsupportedOp("graphopt.rope", f"needs x of rank 4 and tables of rank 3 with a static last dim, "
                                             f"got ranks {rank(x)} and {rank(cos)}")
    heads, dtype = static_dim(x, 1), promote(x, cos, sin)
    x, cos, sin = cast_to(x, dtype), cast_to(cos, dtype), cast_to(sin, dtype)
    tokens = op.Div(op.Size(cos), const(rot_dim, INT64))  # B * S, from the table itself (dynamic shapes)
    positions = op.Reshape(op.Range(const(0, INT64), tokens, const(1, INT64)), op.Shape(cos, start=0, end=2))
    return ms.RotaryEmbedding(
        x, positions, _half_table(cos, rot_dim, interleaved), _half_table(sin, rot_dim, interleaved),
        interleaved=int(interleaved), rotary_embedding_dim=rot_dim, num_heads=heads,
    )


TRANSLATIONS = {graphopt.rope.default: rope}
