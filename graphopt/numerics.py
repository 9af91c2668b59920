"""Comparing outputs: the error measures every check in graphopt reports."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree


@dataclass
class Diff:
    """``max_abs``: largest elementwise difference; ``rel``: ||a - b|| / ||b|| over all
    floating outputs together (0 when both are empty)."""

    max_abs: float
    rel: float

    def to_dict(self) -> dict:
        return {"max_abs_err": self.max_abs, "rel_err": self.rel}


def float_leaves(outputs: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def compare(actual: Any, expected: Any) -> Diff:
    """Error of ``actual`` against ``expected``; shapes must agree leaf by leaf."""
    got, want = float_leaves(actual), float_leaves(expected)
    if len(got) != len(want):
        raise ValueError(f"output count differs: {len(got)} vs {len(want)}")
    max_abs, err_sq, ref_sq = 0.0, 0.0, 0.0
    for a, b in zip(got, want):
        if a.shape != b.shape:
            raise ValueError(f"output shape differs: {tuple(a.shape)} vs {tuple(b.shape)}")
        a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
        delta = (a64 - b64).nan_to_num(nan=float("inf"))
        if delta.numel():
            max_abs = max(max_abs, delta.abs().max().item())
        err_sq += delta.pow(2).sum().item()
        ref_sq += b64.pow(2).sum().item()
    rel = (err_sq ** 0.5) / (ref_sq ** 0.5) if ref_sq > 0 else (0.0 if err_sq == 0 else float("inf"))
    return Diff(max_abs, rel)
