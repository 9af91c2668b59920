"""Shared helpers for defining ``graphopt::`` ops."""

from __future__ import annotations

import torch

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
