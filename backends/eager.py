"""The eager target: run the optimized FX graph as it is.

graphopt ops run their reference implementations, everything else runs as ATen ops
in eager PyTorch. Every other target falls back to this one.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch.fx as fx


class EagerTarget:
    name = "eager"

    def unavailable_reason(self, config) -> str | None:
        return None  # runs wherever PyTorch runs

    def compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any] | None, config) -> Callable:
        return gm


eager = EagerTarget()
