"""The eager target: run the optimized FX graph as it is.

graphopt ops run their reference implementations, everything else runs as ATen ops
in eager PyTorch. Every other target falls back to this one.

The ops a decoder layer is made of (attention, the KV cache, the norms, rope, the QKV
projection, the gated MLP) are called as the plain Python functions they were defined from
rather than through torch's op dispatcher: a decode step calls them a few dozen times on
tiny tensors, where a custom op's dispatch (100-250 us a call on a loaded CPU) costs more
than the work (llama-small, steps 8-24: 1.08x eager through the dispatcher, 1.03x direct).
What they compute is the same function.

The MoE ops are the exception that computes differently: their references are dense (every
expert on every token, so that they trace with fake tensors), and the eager target runs each
expert on its own tokens instead (:func:`graphopt.ops.moe.moe_sparse`): a decode step runs k
experts rather than all of them. Same result up to float32 summation order.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch.fx as fx

from graphopt import ir
from graphopt.ops import op_name, reference_of
from graphopt.ops.moe import moe_sparse
from graphopt.ops.moe_int4 import int4_moe_sparse
from graphopt.targets import Compiled

DIRECT_OPS = ("graphopt.attention", "graphopt.cache_attention", "graphopt.kv_cache_update",
              "graphopt.rope_kv_cache_update", "graphopt.rms_norm", "graphopt.add_rms_norm", "graphopt.rope",
              "graphopt.qkv_proj", "graphopt.swiglu", "graphopt.moe", "graphopt.int4_moe")


def _eager_function(op) -> Callable:
    """What the eager target calls for a graphopt op in DIRECT_OPS: its reference, or the
    sparse MoE dispatch (module docstring)."""
    sparse = {"graphopt.moe": moe_sparse, "graphopt.int4_moe": int4_moe_sparse}
    return sparse.get(op_name(op)) or reference_of(op)


class EagerTarget:
    name = "eager"

    def unavailable_reason(self, config) -> str | None:
        return None  # runs wherever PyTorch runs

    def compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any] | None, config) -> Compiled:
        if not any(n.op == "call_function" and op_name(n.target) in DIRECT_OPS for n in gm.graph.nodes):
            return Compiled(gm)
        lowered = ir.copy_graph_module(gm)  # the caller's graph (reports, CUDA graph capture) keeps its ops
        for node in lowered.graph.nodes:
            if node.op == "call_function" and op_name(node.target) in DIRECT_OPS:
                node.target = _eager_function(node.target)
        lowered.recompile()
        return Compiled(lowered)


eager = EagerTarget()
