"""Before the INT4 rewrite: calibration activations, and which layers get 8 bits.

- :func:`hessians` runs the graph itself (``torch.fx.Interpreter``, every graphopt op has
  a torch reference; a graph whose weights are still in their checkpoint streamed, a node's
  weights at a time) on calibration inputs and sums ``X^T X`` of the input of each GEMM
  to be quantized: what GPTQ feeds errors with, and what an output error is measured on.
- :func:`calibration_inputs` turns token ids into inputs of the graph: the whole text as
  one row when the graph's token axis is symbolic, else rows of the example's shape.
- :func:`allocate_bits` spends a byte budget: every layer starts at 4 bits and layers
  move to 8 bits in order of output error removed per extra byte while the total fits.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from graphopt import lazy_graph
from graphopt.quant.gptq import hessian


def calibration_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any] | None,
                       token_ids: Sequence[int]) -> list[list[Any]]:
    """Argument lists to run ``gm`` on: ``token_ids`` shaped like the first input (integer
    ids), or the example inputs themselves when no ids are given; [] when neither can be."""
    if not token_ids:
        return [list(example_inputs)] if example_inputs else []
    if not example_inputs:  # the graph run alone: one row of ids is the best guess at its input
        return [[torch.tensor([list(token_ids)])]]
    first = next((i for i, x in enumerate(example_inputs) if isinstance(x, torch.Tensor)), None)
    if first is None or example_inputs[first].is_floating_point() or example_inputs[first].dim() != 2:
        raise ValueError("calibration token ids need a graph whose first input is [batch, sequence] token ids; "
                         "leave calibration empty to calibrate on the example inputs")
    if len(example_inputs) > 1 and any(isinstance(x, torch.Tensor) for x in example_inputs[first + 1:]):
        raise ValueError("calibration token ids fit a graph with one tensor input (token ids); leave "
                         "calibration empty to calibrate on the example inputs")
    ids = torch.tensor(list(token_ids), dtype=example_inputs[first].dtype)
    placeholder = next(n for i, n in enumerate(gm.graph.find_nodes(op="placeholder")) if i == first)
    shape = getattr(placeholder.meta.get("val"), "shape", ())
    if len(shape) == 2 and isinstance(shape[1], torch.SymInt) and not shape[1].node.is_constant():
        rows = [ids.view(1, -1)]
    else:  # a static graph: whole rows of the example's shape
        b, s = example_inputs[first].shape
        if ids.numel() < b * s:
            raise ValueError(f"calibration has {ids.numel()} token ids; this graph takes {b} x {s} per run: "
                             f"give at least {b * s}")
        rows = list(ids[: ids.numel() // (b * s) * b * s].view(-1, b, s))
    return [[*example_inputs[:first], r, *example_inputs[first + 1:]] for r in rows]


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, watched: set[fx.Node]) -> None:
        super().__init__(gm)
        self.watched = watched
        self.sums: dict[fx.Node, torch.Tensor] = {}
        self.tokens: dict[fx.Node, int] = {}

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n in self.watched and isinstance(result, torch.Tensor):
            h = hessian(result)
            self.sums[n] = self.sums[n] + h if n in self.sums else h
            self.tokens[n] = self.tokens.get(n, 0) + result.numel() // result.shape[-1]
        return result


def hessians(gm: fx.GraphModule, inputs: list[list[Any]], watched: set[fx.Node],
              each: Callable[[fx.Node, tuple[torch.Tensor, int]], None] | None = None
              ) -> dict[fx.Node, tuple[torch.Tensor, int]]:
    """``(sum X^T X, tokens)`` over ``inputs`` of each watched node's value (a GEMM's input).

    A graph whose weights are still in their checkpoint runs streamed (graphopt.lazy_graph:
    each weight read when a node needs it), and with ``each`` every node's sum goes to
    ``each(node, sum)`` as soon as it is complete instead of into the result: on a pure graph
    (all inputs run in step) that is right after the node, so one Hessian is held at a time.
    The sums are the in-memory run's, bit for bit: the same values added in the same order."""
    if lazy_graph.has_lazy_constants(gm):
        return _streamed_hessians(gm, inputs, watched, each)
    recorder = _Recorder(gm, watched)
    with torch.no_grad():
        for args in inputs:
            recorder.run(*args)
    found = {n: (h, recorder.tokens[n]) for n, h in recorder.sums.items()}
    if each is None:
        return found
    for n, h in found.items():
        each(n, h)
    return {}


def _streamed_hessians(gm: fx.GraphModule, inputs: list[list[Any]], watched: set[fx.Node],
                       each: Callable[[fx.Node, tuple[torch.Tensor, int]], None] | None):
    sums: dict[fx.Node, torch.Tensor] = {}
    tokens: dict[fx.Node, int] = {}
    in_step = lazy_graph.in_step(gm)

    def seen(node: fx.Node, values: list[Any]) -> None:
        for value in values:
            if isinstance(value, torch.Tensor):
                h = hessian(value)
                sums[node] = sums[node] + h if node in sums else h
                tokens[node] = tokens.get(node, 0) + value.numel() // value.shape[-1]
        if in_step and each is not None and node in sums:  # every input set seen: the sum is complete
            each(node, (sums.pop(node), tokens[node]))

    with torch.no_grad():
        lazy_graph.run(gm, inputs, watched=watched, on_value=seen, outputs=False)
    found = {n: (h, tokens[n]) for n, h in sums.items()}
    if each is None:
        return found
    for n, h in found.items():
        each(n, h)
    return {}


def allocate_bits(layers: list[dict[str, Any]], budget: float) -> None:
    """Set ``layer["bits"]`` to 8 for the layers that buy the most output error per byte
    while ``sum(bytes) <= budget * sum(bytes_fp32)``; ``layer`` holds ``bytes4``, ``bytes8``,
    ``error4``, ``error8`` and ``bits`` (its starting width: 8 stays 8)."""
    limit = budget * sum(layer["bytes_fp32"] for layer in layers)
    total = sum(layer["bytes8"] if layer["bits"] == 8 else layer["bytes4"] for layer in layers)
    if total > limit:
        raise ValueError(f"budget {budget} is below what 4 bits take ({total / limit * budget:.3f} of fp32); "
                         "raise the budget")
    order = sorted((layer for layer in layers if layer["bits"] == 4),
                   key=lambda layer: (layer["error4"] - layer["error8"]) / max(1, layer["bytes8"] - layer["bytes4"]),
                   reverse=True)
    for layer in order:
        extra = layer["bytes8"] - layer["bytes4"]
        if total + extra <= limit:
            layer["bits"] = 8
            total += extra
