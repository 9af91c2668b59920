"""fuse_attention's operand helpers: q, k and v behind the layout copies and GQA's
repeat_kv that eager attention puts in front of them, and the checks on their shapes.

A helper of one pass (``passes/fuse_attention.py``), not a pass.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from graphopt.rewrite import VIEW_OPS, expect, is_cast, is_op, scalar, val

aten = torch.ops.aten


def perm(node: fx.Node) -> list[int] | None:
    """The permutation a permute/transpose node applies, or None."""
    if is_op(node, aten.permute.default):
        return [d % val(node).dim() for d in node.args[1]]
    if is_op(node, aten.transpose.int):
        rank = val(node).dim()
        a, b = (d % rank for d in node.args[1:3])
        order = list(range(rank))
        order[a], order[b] = order[b], order[a]
        return order
    return None


def skip_layout_copies(node: Any) -> Any:
    """Look through copies that change only the memory layout: ``clone`` and ``permute -> clone
    -> permute back``. The op reads values, not strides, so the copies die."""
    for _ in range(4):
        outer = perm(node)
        if is_op(node, aten.clone.default) and node.kwargs.get("memory_format") in (
                None, torch.contiguous_format, torch.preserve_format):
            node = node.args[0]
        elif outer is not None and is_op(node.args[0], aten.clone.default) \
                and perm(node.args[0].args[0]) is not None \
                and [perm(node.args[0].args[0])[d] for d in outer] == sorted(outer):
            node = node.args[0].args[0].args[0]
        else:
            break
    return node


def unrepeat_kv(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(kv, groups) for transformers' repeat_kv: ``view(clone(expand(kv[:, :, None], [B, Hkv, n, S, D])),
    [B, Hkv * n, S, D])``; None for any other tensor."""
    if not is_op(node, *VIEW_OPS):
        return None
    inner = node.args[0]
    if is_op(inner, aten.clone.default):
        inner = inner.args[0]
    if not is_op(inner, aten.expand.default) or not is_op(inner.args[0], aten.unsqueeze.default):
        return None
    unsq = inner.args[0]
    kv = unsq.args[0]
    if unsq.args[1] % 5 != 2 or val(kv).dim() != 4:
        return None
    b, hkv, s, d = val(kv).shape
    wide = tuple(val(inner).shape)
    if wide[:2] != (b, hkv) or wide[3:] != (s, d):
        return None
    if tuple(val(node).shape) != (b, hkv * wide[2], s, d):
        return None
    return kv, wide[2]


def narrow_kv(k: fx.Node, v: fx.Node) -> tuple[fx.Node, fx.Node]:
    """k and v before repeat_kv when both went through it with the same group count."""
    k, v = skip_layout_copies(k), skip_layout_copies(v)
    rk, rv = unrepeat_kv(k), unrepeat_kv(v)
    if rk is not None and rv is not None and rk[1] == rv[1]:
        return skip_layout_copies(rk[0]), skip_layout_copies(rv[0])
    return k, v


def strip_upcast(node: Any) -> Any:
    """x for ``x.float()`` of a narrower float x: the op computes in float32 anyway."""
    if is_cast(node) and val(node).dtype == torch.float32 and val(node.args[0]).dtype in (
            torch.float16, torch.bfloat16):
        return node.args[0]
    return node


def as_bool_mask(mask: Any) -> Any:
    """m for ``where(m, 0, -inf)`` of a boolean m (how SDPA's callers turn m additive): the op
    takes m itself and reads one byte per element instead of four."""
    if is_op(mask, aten.where.self) and val(mask.args[0]).dtype == torch.bool \
            and scalar(mask.args[1]) == 0.0 and scalar(mask.args[2]) == float("-inf") \
            and tuple(val(mask.args[0]).shape) == tuple(val(mask).shape):
        return mask.args[0]
    return mask


def _same_length(a, b) -> bool:
    """k and v lengths that are equal for every input the graph takes: the same size, or two
    symbols that were equal when traced. Those are related without a guard: SDPA needs them
    equal (its product with v fails otherwise), so an input where they differ fails in eager
    as in every lowering of the fused op (ONNX Runtime's checks, the Triton wrapper's), and a
    guard would only add a warning and a note to every transformers model with a dynamic
    cache, whose keys and values are two tensors with a symbol each. A symbol against a
    constant is not the same length: comparing them would pin the symbol to the constant, and
    the graph would recompile for every other length (eager's CPU SDPA accepts such inputs)."""
    if statically_known_true(a == b):
        return True
    if not (isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt)):
        return False
    hint_a, hint_b = a.node.hint, b.node.hint
    return hint_a is not None and hint_a == hint_b


def check_shapes(q: fx.Node, k: fx.Node, v: fx.Node, mask: fx.Node | None) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        expect(isinstance(val(t), torch.Tensor) and val(t).dim() == 4,
               f"{name} has rank {val(t).dim() if isinstance(val(t), torch.Tensor) else '?'}, expected 4 "
               "[B, H, S, D]", t)
    (b, hq, sq, d), (bk, hkv, skv, dk), (bv, hv, sv, _) = val(q).shape, val(k).shape, val(v).shape
    expect(b == bk == bv, f"batch sizes {b}, {bk}, {bv} of q, k, v differ", k)
    expect(hkv == hv and _same_length(skv, sv), f"k [.., {hkv}, {skv}, ..] and v [.., {hv}, {sv}, ..] differ", v)
    expect(d == dk, f"q head dim {d} != k head dim {dk}", k)
    expect(hq % hkv == 0, f"k/v heads {hkv} do not divide q heads {hq}", k)
    if mask is None:
        return
    expect(isinstance(mask, fx.Node) and isinstance(val(mask), torch.Tensor), "mask is not a tensor")
    target = [b, hq, sq, skv]
    shape = list(val(mask).shape)
    fits = len(shape) <= 4 and all(m in (1, t) for m, t in zip(reversed(shape), reversed(target)))
    expect(fits, f"mask {shape} does not broadcast to [B, Hq, Sq, Skv] = {target}", mask)
