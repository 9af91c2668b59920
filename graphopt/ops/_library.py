"""Shared helpers for defining ``graphopt::`` ops."""

from __future__ import annotations

from typing import Callable

import torch

from graphopt.errors import GraphoptError

NAMESPACE = "graphopt"

# Every op defined under graphopt/ops, by short name ("rms_norm"), in definition order.
OPS: dict[str, torch._ops.OpOverloadPacket] = {}


def register(name: str) -> torch._ops.OpOverloadPacket:
    """Record an op defined with ``torch.library.custom_op("graphopt::<name>")``."""
    packet = getattr(getattr(torch.ops, NAMESPACE), name)
    OPS[name] = packet
    return packet


def op_name(target: object) -> str | None:
    """``"graphopt.rms_norm"`` for a graphopt op overload or packet, else None."""
    schema_name = getattr(target, "_schema", None)
    name = getattr(schema_name, "name", None) if schema_name is not None else None
    if name is None:
        name = getattr(target, "_qualified_op_name", None)
    if name and name.startswith(NAMESPACE + "::"):
        return NAMESPACE + "." + name.split("::", 1)[1]
    return None


def reference_of(op: torch._ops.OpOverload) -> Callable:
    """The plain-torch function a ``graphopt::`` op was defined from.

    torch has no public accessor for a custom op's Python body; this is its one use here.
    """
    from torch._library.custom_ops import _maybe_get_opdef

    opdef = _maybe_get_opdef(op)
    fn = getattr(opdef, "_init_fn", None)
    if fn is None:
        raise GraphoptError(f"{op_name(op) or op} has no Python reference to decompose")
    return fn
