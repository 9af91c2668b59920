"""A second shape for each generated case: the same compiled model called again at
another batch or sequence length, as a server calls it with prompts of other lengths.

The generator draws one ``[B, S, H]`` (or ``[S, H]``) shape per case and the emitted code
reads batch and sequence sizes from its inputs, so most cases run at any length. Which
axis a case really allows is found by trying: every input axis of the old size gets the
new size (rotary tables and masks follow the sequence; a size of 1 changes only at that
axis of inputs shaped like the first, since 1 is also every broadcast axis), and the
resized inputs count only when eager runs them to finite outputs (a weight sized along
the axis, a norm over it, would refuse them). Axes of size 2 or more come first: dynamo specializes a size of 1,
so growing one costs a second (symbolic) compile, which the fuzzer counts as a recompile;
it is tried last, so that a case with only such axes still runs at two shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from graphopt.fuzz.case import Case
from graphopt.fuzz.check import Reference, first_line, reference
from graphopt.fuzz.source import resized_inputs


@dataclass
class Shape:
    """The case's inputs at another length, and eager's outputs for them."""

    axis: str  # "sequence" | "batch"
    old: int
    new: int
    inputs: tuple[Any, ...]
    ref: Reference

    def describe(self) -> str:
        return f"{self.axis} {self.new} (compiled at {self.old})"


def _first_shape(case: Case) -> tuple[int, ...] | None:
    return next((i.value.shape for i in case.inputs if len(i.value.shape) >= 2 and i.fill == "randn"), None)


def resized_shapes(case: Case, axis: str, old: int, new: int) -> list[tuple[int, ...]]:
    """Each input's shape with the ``axis`` of size ``old`` grown to ``new``."""
    first = _first_shape(case)
    position = len(first) - 2 if axis == "sequence" else 0
    out = []
    for i in case.inputs:
        shape = list(i.value.shape)
        if old >= 2:
            shape = [new if n == old else n for n in shape]
        elif len(shape) == len(first) and i.fill == "randn":
            shape[position] = new
        elif axis == "sequence" and i.fill != "randn" and i.fill != "eps":
            shape[0] = new  # a rotary table: one row per position
        out.append(tuple(shape))
    return out


def candidate_axes(case: Case) -> list[tuple[str, int, int]]:
    """(axis, old size, new size) to try: sequence first (the axis a prompt varies), sizes
    of 1 last."""
    first = _first_shape(case)
    if first is None:
        return []
    named = [("sequence", first[-2], first[-2] + 2)]
    if len(first) == 3:
        named.append(("batch", first[0], first[0] + 1))
    return sorted(named, key=lambda c: c[1] < 2)  # stable: the order above within each group


def second_shape(case: Case, module: torch.nn.Module) -> tuple[Shape | None, str]:
    """(the case at a second length, "") or (None, why no axis can vary)."""
    tried = []
    for axis, old, new in candidate_axes(case):
        try:
            inputs = resized_inputs(case, resized_shapes(case, axis, old, new))
        except Exception as error:  # an input the generator cannot fill at that size
            tried.append(f"{axis}: {first_line(error)}")
            continue
        ref = reference(module, inputs)
        if ref.problem is None:
            return Shape(axis, old, new, inputs, ref), ""
        tried.append(f"{axis}: {ref.problem}")
    return None, "; ".join(tried) or "no batch or sequence axis"

