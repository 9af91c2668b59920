"""Proving a written model against eager PyTorch: inputs of a second shape, the file run in its
runtime on each input set, the error and top-1 agreement.

The eager side runs first, on every input set, and only then is the file opened, so the
reference and the runtime's session are never in memory together. A reference whose weights
are still in their checkpoint (the optimized graph of a streamed export: its constants are
lazy, graphopt/lazy_weights.py) runs node by node on all the input sets at once
(graphopt/lazy_graph.py): each weight is read when a node uses it and dropped after that
node, so one layer's weights are in memory at a time, each read once, in the dtype the file
holds them (a float32 export of a bf16 checkpoint: float32, converted a tensor at a time),
and the outputs are the ones the graph with every weight read in gives, bit for bit.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from graphopt import lazy_graph
from graphopt.errors import GraphoptError


def resample_like(inputs: Sequence[Any], grow: tuple[int, ...] = (1, 3), seed: int = 1) -> list[Any]:
    """Inputs of another shape for validation: the first axes grown by ``grow``, integer
    values drawn from the range the originals use (token ids stay in the vocabulary, an
    all-ones mask stays ones), floats from a normal distribution."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for x in inputs:
        if not isinstance(x, torch.Tensor):
            out.append(x)
            continue
        shape = [s + (grow[i] if i < len(grow) else 0) for i, s in enumerate(x.shape)]
        if x.dtype.is_floating_point:
            out.append(torch.randn(shape, generator=gen, dtype=x.dtype))
        elif x.dtype == torch.bool:
            out.append(torch.ones(shape, dtype=torch.bool))
        else:
            low, high = int(x.min()), int(x.max())
            out.append(torch.randint(low, high + 1, shape, generator=gen, dtype=x.dtype))
    return out


def validate(path: str, module: torch.nn.Module, input_sets: Sequence[Sequence[torch.Tensor]], provider: str,
             flatten: Callable[[Any], list[torch.Tensor]], exporter: Any) -> list[dict]:
    """Run the saved file in ``exporter``'s runtime on each input set and compare with ``module``
    (eager, or a graph whose lazy constants are read as it runs: ``reference_outputs``)."""
    from graphopt.numerics import compare

    rows = []
    references = [flatten(out) for out in reference_outputs(module, input_sets)]
    runner = exporter.open(path, provider)  # one line, naming the file, when the runtime cannot load it
    for inputs, expected in zip(input_sets, references):
        try:
            actual = runner(*inputs)
        except Exception as error:
            shapes = [list(t.shape) for t in inputs]
            raise GraphoptError(f"{path} fails in {exporter.runtime} on inputs {shapes}: {first_line(error)}") from error
        diff = compare(actual, expected)
        rows.append({"input_shapes": [list(t.shape) for t in inputs], "max_abs_err": diff.max_abs, "rel_err": diff.rel,
                     "top1_agreement": top1_agreement(actual[0], expected[0])})
    return rows


def reference_outputs(module: Callable[..., Any], input_sets: Sequence[Sequence[Any]]) -> list[Any]:
    """``module(*inputs)`` for each input set, without gradients; a graph with lazy constants
    runs streamed (``graphopt.lazy_graph.run``) instead of reading them all in."""
    with torch.no_grad():
        if isinstance(module, fx.GraphModule) and lazy_graph.has_lazy_constants(module):
            return lazy_graph.run(module, input_sets)
        return [module(*inputs) for inputs in input_sets]


def top1_agreement(actual: torch.Tensor, expected: torch.Tensor) -> float | None:
    """graphopt.quant.report.top1_agreement for an output that has a vocabulary-like last axis (a
    float tensor of rank >= 2); None for any other output."""
    from graphopt.quant.report import top1_agreement as agreement

    if not expected.is_floating_point() or expected.dim() < 2 or expected.shape[-1] < 2:
        return None
    return agreement(actual, expected)


def flatten_outputs(outputs: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor)]


def first_line(error: BaseException) -> str:
    """``Type: first line of the message``, at most 300 characters: an error in one line."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]
