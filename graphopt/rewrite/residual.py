"""The residual add in front of a norm: the skip connection a fused ``add + norm`` op reads.

ORT's Skip*LayerNormalization and graphopt's ``add_rms_norm`` / ``add_layer_norm`` take
two tensors of one shape and dtype and return the norm of their sum and the sum itself.
One matcher decides whether an ``aten.add`` is such a sum, with one set of reasons, for
every norm pass that folds the add in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.rewrite.aten_ops import ADD_OPS
from graphopt.rewrite.casts import dtype_name
from graphopt.rewrite.match import NoMatch, expect, is_op, scalar, val

aten = torch.ops.aten


@dataclass
class ResidualAdd:
    """``add = a + b``."""

    add: fx.Node
    a: fx.Node
    b: fx.Node


def match_residual_add(node: Any, what: str) -> ResidualAdd:
    """``node`` as ``a + b`` of two tensors with the sum's shape and dtype and no alpha;
    raises NoMatch saying why not (``what`` names the role of ``node`` when it is no add)."""
    if not is_op(node, *ADD_OPS):
        # one message for both overloads: "expected aten.add or aten.add" would read oddly
        found = ir.target_name(node.target) if isinstance(node, fx.Node) else repr(node)
        raise NoMatch(f"{what}: expected aten.add, found {found}", node if isinstance(node, fx.Node) else None)
    expect(node.target is aten.add.Tensor, f"add of a scalar {node.args[1]!r}", node)
    a, b = node.args[0], node.args[1]
    alpha = node.kwargs.get("alpha", node.args[2] if len(node.args) > 2 else 1)
    expect(scalar(alpha) == 1.0, f"add with alpha {alpha}", node)
    for operand in (a, b):
        # a 0-d constant is a scalar too: the fused ops add a whole second tensor
        if not isinstance(val(operand), torch.Tensor) or scalar(operand) is not None:
            shown = scalar(operand) if scalar(operand) is not None else operand
            raise NoMatch(f"add of a scalar {shown!r}", node)
    total = val(node)
    for operand in (a, b):
        shape = list(val(operand).shape)
        expect(shape == list(total.shape), f"residual add broadcasts {shape} to {list(total.shape)}", node)
    expect(val(a).dtype == val(b).dtype == total.dtype,
           f"residual add mixes {dtype_name(val(a).dtype)} and {dtype_name(val(b).dtype)}", node)
    return ResidualAdd(node, a, b)
