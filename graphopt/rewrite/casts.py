"""Dtype casts in patterns: recognising them, walking through them, and casting a fused
op's result back to the dtype of the value it replaces."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.rewrite.aten_ops import CAST_OPS
from graphopt.rewrite.match import is_op, val

aten = torch.ops.aten

FLOAT_BITS = {torch.float16: 16, torch.bfloat16: 16, torch.float32: 32, torch.float64: 64}


def is_cast(node: Any) -> bool:
    """A dtype cast that changes nothing else: ``prims.convert_element_type``, or
    ``_to_copy(x, dtype=...)`` possibly with ``layout=strided`` and x's own device (the
    form ``type_as`` and ``softmax(dtype=...)`` lower to)."""
    if not is_op(node, *CAST_OPS):
        return False
    if node.target is not aten._to_copy.default:
        return True
    if len(node.args) != 1 or not set(node.kwargs) <= {"dtype", "layout", "device"}:
        return False
    if set(node.kwargs) <= {"dtype"}:
        return True
    src, out = val(node.args[0]), val(node)
    return (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)
            and node.kwargs.get("layout", torch.strided) == torch.strided
            and src.layout == torch.strided and src.device == out.device)


def strip_casts(node: Any) -> Any:
    """Walk up through dtype casts: ``x.float().to(fp16)`` matches as ``x``."""
    while is_cast(node):
        node = node.args[0]
    return node


def is_exact_upcast(src: torch.dtype, dst: torch.dtype) -> bool:
    """Every value of ``src`` is exactly representable in ``dst`` (f16/bf16 -> f32 -> f64)."""
    return src in FLOAT_BITS and dst in FLOAT_BITS and FLOAT_BITS[dst] > FLOAT_BITS[src]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def cast_back_user(node: fx.Node, dtype: torch.dtype) -> fx.Node | None:
    """``node``'s only user when that user is a cast to ``dtype``, else None."""
    if len(node.users) != 1:
        return None
    user = next(iter(node.users))
    return user if is_cast(user) and val(user).dtype == dtype else None


def cast_like(gm: fx.GraphModule, node: fx.Node, like: fx.Node) -> fx.Node:
    """``node``, or a cast of it when its dtype differs from the value ``like`` it replaces.

    Call inside the rewrite's ``inserting_*`` context; fills ``node.meta["val"]``.
    """
    ir.infer_val(node)
    want = val(like).dtype
    if node.meta["val"].dtype == want:
        return node
    return gm.graph.call_function(aten._to_copy.default, (node,), {"dtype": want})
