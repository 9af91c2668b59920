"""Small matchers a pattern is walked with: guard clauses that raise :class:`NoMatch`
with a reason (what ``graphopt debug --why`` prints), op and operand tests, constants.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx

from graphopt import ir

aten = torch.ops.aten


class NoMatch(Exception):
    """Raised by a matcher: ``reason`` says why, ``node`` where matching stopped."""

    def __init__(self, reason: str, node: fx.Node | None = None):
        super().__init__(reason)
        self.reason = reason
        self.node = node


def expect(condition: bool, reason: str, node: Any = None) -> None:
    """Guard clause for matchers: raise NoMatch(reason) unless ``condition``."""
    if not condition:
        raise NoMatch(reason, node if isinstance(node, fx.Node) else None)


def is_op(node: Any, *targets: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def expect_op(node: Any, targets: Iterable[Any] | Any, what: str) -> fx.Node:
    """``node`` must call one of ``targets``; ``what`` names the role in the reason."""
    targets = tuple(targets) if isinstance(targets, (tuple, list, set)) else (targets,)
    if not is_op(node, *targets):
        found = ir.target_name(node.target) if isinstance(node, fx.Node) else repr(node)
        expected = " or ".join(dict.fromkeys(ir.target_name(t) for t in targets))  # names once
        raise NoMatch(f"{what}: expected {expected}, found {found}", node if isinstance(node, fx.Node) else None)
    return node


def only_user(node: fx.Node, what: str) -> fx.Node:
    """The single user of ``node``; fusing away a value another node reads would lose it."""
    expect(len(node.users) == 1, f"{what} {node.name} has {len(node.users)} users, expected 1", node)
    return next(iter(node.users))


def single_use(node: fx.Node, what: str) -> fx.Node:
    """Check ``node`` is read once (it will be fused away) and return it."""
    expect(len(node.users) == 1, f"{what} {node.name} has {len(node.users)} users; a fusion would lose the others", node)
    return node


def scalar(value: Any) -> float | None:
    """A Python number for a literal, or a 0-d constant / scalar_tensor node; else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Number):
        return float(value)
    if is_op(value, aten.scalar_tensor.default) and isinstance(value.args[0], numbers.Number):
        return float(value.args[0])
    if is_op(value, aten.lift_fresh_copy.default):
        value = value.args[0]
    const = ir.get_constant(value)
    if const is not None and const.numel() == 1:
        return float(const.item())
    return None


def val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def last_dim(node: fx.Node) -> int | None:
    v = val(node)
    return v.dim() - 1 if isinstance(v, torch.Tensor) else None


def is_last_dim(dims: Any, node: fx.Node) -> bool:
    """``dims`` (an int or a one-element list) names the last axis of ``node``'s value."""
    if isinstance(dims, (list, tuple)):
        if len(dims) != 1:
            return False
        dims = dims[0]
    rank = last_dim(node)
    return isinstance(dims, int) and rank is not None and dims in (-1, rank)


def call_args(node: fx.Node) -> dict[str, Any]:
    """The arguments of an op call by schema name, defaults filled in."""
    bound = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            bound[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            bound[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


def commuted(node: fx.Node, test: Callable[[Any], bool], what: str) -> tuple[Any, Any]:
    """``(operand, other)`` of a commutative binary op, ``operand`` being the one that
    passes ``test``: ``a * b`` and ``b * a`` match one pattern. The first operand wins a tie."""
    a, b = node.args[0], node.args[1]
    if test(a):
        return a, b
    if test(b):
        return b, a
    raise NoMatch(f"neither operand of {node.name} is {what}", node)
