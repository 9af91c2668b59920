"""The ``torch.compile`` backend: ``torch.compile(model, backend="graphopt", options={...})``.

Registered in the ``torch_dynamo_backends`` entry-point group, so it works right after
``pip install``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch.fx as fx

import graphopt.ops  # noqa: F401  (registers the graphopt:: ops before any graph uses them)
from graphopt.compiler import compile_graph
from graphopt.config import Options
from graphopt.errors import OptionsError
from graphopt.frontend.trace import compile_dynamo_graph


def graphopt_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict | None = None,
                     mode: str | None = None, **unknown: Any) -> Callable:
    """Compile one dynamo graph with graphopt's passes and the configured target."""
    if unknown:
        raise OptionsError(f"unexpected torch.compile argument(s) {', '.join(unknown)}; pass graphopt settings in options={{...}}")
    if mode not in (None, "default"):
        raise OptionsError(f"torch.compile mode={mode!r} means nothing to graphopt; use options={{...}} (see graphopt run --help)")
    return compile_dynamo_graph(gm, example_inputs, Options.parse(options), compile_graph)
