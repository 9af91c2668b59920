"""The eager target: run the optimized FX graph as it is.

graphopt ops run their reference implementations, everything else runs as ATen ops
in eager PyTorch. Every other target falls back to this one.

The ops a decoder layer is made of (attention, the KV cache, the norms, rope, the QKV
projection, the gated MLP) are called as the plain Python functions they were defined from
rather than through torch's op dispatcher: a decode step calls them a few dozen times on
tiny tensors, where a custom op's dispatch (100-250 us a call on a loaded CPU) costs more
than the work (llama-small, steps 8-24: 1.08x eager through the dispatcher, 1.03x direct).
What they compute is the same function.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch.fx as fx

from graphopt import ir
from graphopt.decompose import reference_of
from graphopt.ops import op_name

DIRECT_OPS = ("graphopt.attention", "graphopt.cache_attention", "graphopt.kv_cache_update",
              "graphopt.rms_norm", "graphopt.add_rms_norm", "graphopt.rope", "graphopt.qkv_proj", "graphopt.swiglu")


class EagerTarget:
    name = "eager"

    def unavailable_reason(self, config) -> str | None:
        return None  # runs wherever PyTorch runs

    def compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any] | None, config) -> Callable:
        if not any(n.op == "call_function" and op_name(n.target) in DIRECT_OPS for n in gm.graph.nodes):
            return gm
        lowered = ir.copy_graph_module(gm)  # the caller's graph (reports, CUDA graph capture) keeps its ops
        for node in lowered.graph.nodes:
            if node.op == "call_function" and op_name(node.target) in DIRECT_OPS:
                node.target = reference_of(node.target)
        lowered.recompile()
        return lowered


eager = EagerTarget()
