"""A value cut into pieces along its last axis: one merged projection read as several.

Models that store two or three projections as one weight (``gate_up_proj``, ``qkv_proj``)
cut the GEMM's output with ``chunk`` / ``split`` (aot: ``aten.split.Tensor`` or
``split_with_sizes`` + ``getitem``) or with slicing (``aten.slice.Tensor``). The fused ops
read such an output whole, so a pass needs to know which rows of the weight each piece is.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from graphopt import ir
from graphopt.rewrite.aten_ops import SPLIT_OPS
from graphopt.rewrite.match import NoMatch, expect, is_last_dim, is_op, val

aten = torch.ops.aten


@dataclass(frozen=True)
class Piece:
    """``node`` is ``value[..., start:end]``."""

    node: fx.Node
    start: int
    end: int

    @property
    def width(self) -> int:
        return self.end - self.start


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _slice_piece(node: fx.Node, width: int) -> Piece | None:
    """``value[..., a:b]`` as a Piece; None when it slices another axis or with a step."""
    args = list(node.args) + [None] * (5 - len(node.args))
    dim = node.kwargs.get("dim", args[1] if args[1] is not None else 0)
    start = node.kwargs.get("start", args[2])
    end = node.kwargs.get("end", args[3])
    step = node.kwargs.get("step", args[4] if args[4] is not None else 1)
    if not is_last_dim(dim, node.args[0]) or step != 1:
        return None
    start, end = _int(0 if start is None else start), _int(width if end is None else end)
    if start is None or end is None:
        return None
    start, end = (s + width if s < 0 else s for s in (start, end))
    start, end = max(0, min(start, width)), max(0, min(end, width))
    return Piece(node, start, end) if end > start else None


def _split_pieces(split: fx.Node, width: int) -> list[Piece] | None:
    """The getitems of ``split``/``split_with_sizes``/``chunk`` over the last axis."""
    dim = split.kwargs.get("dim", split.args[2] if len(split.args) > 2 else 0)
    if not is_last_dim(dim, split.args[0]):
        return None
    arg = split.args[1]
    if split.target is aten.chunk.default:
        chunks = _int(arg)
        if not chunks or width % chunks:
            return None
        sizes = [width // chunks] * chunks
    elif isinstance(arg, (list, tuple)):
        sizes = [_int(s) for s in arg]
    else:
        size = _int(arg)
        if not size:
            return None
        sizes = [min(size, width - i) for i in range(0, width, size)]
    if any(s is None for s in sizes) or sum(sizes) != width:
        return None
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    pieces = []
    for user in split.users:
        if not is_op(user, operator.getitem) or not isinstance(user.args[1], int):
            return None  # the tuple read whole: the pieces are not all known
        i = user.args[1]
        pieces.append(Piece(user, starts[i], starts[i] + sizes[i]))
    return pieces


def last_dim_pieces(value: fx.Node, what: str) -> list[Piece]:
    """Every user of ``value`` as a piece of its last axis, in order of ``start``.

    Raises NoMatch when some user reads ``value`` otherwise (then it is not only cut in
    pieces, and a fused op replacing the pieces would not replace ``value``) or when the
    pieces overlap or leave a gap (then they are not one projection's parts).
    """
    v = val(value)
    expect(isinstance(v, torch.Tensor) and v.dim() >= 1, f"{what} {value.name} is not a tensor", value)
    width = v.shape[-1]
    expect(isinstance(width, int), f"{what} {value.name} has a symbolic last dim", value)
    pieces: list[Piece] = []
    for user in value.users:
        found = None
        if is_op(user, aten.slice.Tensor) and user.args[0] is value:
            found = [_slice_piece(user, width)]
        elif is_op(user, *SPLIT_OPS) and user.args[0] is value:
            found = _split_pieces(user, width)
        if not found or None in found:
            raise NoMatch(f"{what} {value.name} is read by {user.name} ({_describe(user)}), "
                          "not only cut in pieces along its last dim", user)
        pieces.extend(found)
    pieces.sort(key=lambda p: (p.start, p.end))
    expect(bool(pieces), f"{what} {value.name} has no users", value)
    edges = [0] + [p.end for p in pieces]
    expect(all(p.start == e for p, e in zip(pieces, edges)) and edges[-1] == width,
           f"the pieces of {what} {value.name} ({', '.join(f'[{p.start}:{p.end}]' for p in pieces)}) "
           f"do not tile its {width} columns", value)
    return pieces


def same_leading_dims(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes but for the last dim, also for symbolic sizes (without adding guards)."""
    return a.dim() == b.dim() and all(statically_known_true(p == q) for p, q in zip(a.shape[:-1], b.shape[:-1]))


def _describe(node: fx.Node) -> str:
    return ir.target_name(node.target) if node.op == "call_function" else node.op
