"""Outputs a dynamic session writes into torch tensors allocated before the run.

Why: a session that serves every shape would keep, with ONNX Runtime's CPU memory arena, the
memory of its longest call for the rest of its life (+0.9 GB resident after a 4x512 call on
llama-small); with the arena off, every large intermediate is a fresh glibc ``mmap`` and page
faults anew each time (GroupQueryAttention's 67 MB probabilities and the 46 MB gate/up
product in each layer: 1.2 GB of faults per 4x512 call against eager's 0.8 GB, which made the
call ~10% slower than eager). So a dynamic CPU session keeps the arena and asks ORT to shrink
it after a run at new input shapes (``memory.enable_memory_arena_shrinkage``): inside the run
the layers reuse the arena's blocks, and after it the memory goes back to the OS. A run that
repeats the previous run's shapes keeps the arena, since shrinking after it would make the
next run fault the same memory back in (``runtime/graph_runner.py``).

The shrink frees only arena regions with nothing in use, and the run's outputs are still in
use when it happens: outputs from the arena would pin their regions (the 262 MB logits and
what shares their region). So the outputs are torch tensors allocated before the run, whose
shapes are the graph's symbolic output shapes evaluated on the run's sizes, and bound to it;
the large ones each in a mapping of their own (``empty_output``), so they leave no memory
behind in glibc's heap when the caller drops them.

``BoundOutputs.of`` returns None when an output's shape cannot be computed from the inputs'
sizes (a data-dependent size) or has no numpy dtype; the session then keeps the arena off.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from graphopt.backends.onnxruntime.runtime.session import numpy_holds
from graphopt.backends.onnxruntime.lower.signatures import SizePlan


def release_arena_options():
    """RunOptions that shrink the CPU arena at the end of a run."""
    import onnxruntime

    options = onnxruntime.RunOptions()
    options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    return options


OWN_MAPPING_BYTES = 1 << 20


def empty_output(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An empty output tensor; from ``OWN_MAPPING_BYTES`` up, in an anonymous mapping of its own.

    Why: a large output's pages must go back to the OS when the caller drops it. From glibc's
    heap they need not: a chunk freed below a live one stays resident until a trim, and the
    caller frees our outputs after the run, where no trim follows. llama-small's twelve
    shapes left up to 300 MB resident that way after the 4x512 call (1.15x the memory after
    call 2, against 1.014x with outputs in their own mappings; same call times). The
    mapping lives as long as the tensor's storage."""
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if nbytes < OWN_MAPPING_BYTES:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=count)
    # set_ rather than view: the output is a tensor of its own (no _base), as torch.empty's is
    return torch.empty((), dtype=dtype).set_(flat.untyped_storage(), 0, tuple(shape))


@dataclass
class BoundOutputs:
    """Per graph output position: (size functions, dtype), or None for a non-tensor output."""

    specs: list[tuple[list[Callable[..., int]], torch.dtype] | None]
    sources: list[tuple[int, int | None]]  # each symbol's (graph input, axis or None for a SymInt)

    @classmethod
    def of(cls, gm: fx.GraphModule, plan: SizePlan) -> "BoundOutputs | None":
        symbols = list(plan.sources)
        outputs = gm.graph.output_node().args[0]
        outputs = outputs if isinstance(outputs, (tuple, list)) else [outputs]
        specs: list = []
        for out in outputs:
            val = out.meta.get("val") if isinstance(out, fx.Node) else None
            if not isinstance(val, torch.Tensor):
                specs.append(None)
                continue
            if not numpy_holds(val.dtype) or val.device.type != "cpu":
                return None
            sizes = [_size_function(s, symbols) for s in val.shape]
            if any(f is None for f in sizes):
                return None
            specs.append((sizes, val.dtype))
        return cls(specs, [plan.sources[s] for s in symbols])

    def allocate(self, onnx_positions: Sequence[int], args: Sequence[Any]) -> list[torch.Tensor] | None:
        """Empty tensors for the ONNX outputs, ``onnx_positions[k]`` being the graph output
        ONNX output k returns; None when an output is empty (nothing to bind an address to)."""
        values = [args[i] if axis is None else args[i].shape[axis] for i, axis in self.sources]
        tensors = []
        for position in onnx_positions:
            sizes, dtype = self.specs[position]
            shape = [f(*values) for f in sizes]
            if 0 in shape:
                return None
            tensors.append(empty_output(shape, dtype))
        return tensors

    def onnx_positions(self, output_plan: Sequence[Any], onnx_outputs: int) -> list[int] | None:
        """For each ONNX output, a graph output it returns (from the export's output plan)."""
        positions: dict[int, int] = {}
        for position, p in enumerate(output_plan):
            if isinstance(p, int) and self.specs[position] is not None:
                positions.setdefault(p, position)
        if sorted(positions) != list(range(onnx_outputs)):
            return None
        return [positions[k] for k in range(onnx_outputs)]


def _size_function(size: Any, symbols: list) -> Callable[..., int] | None:
    """A fast function of the symbols' values giving ``size``; None when it depends on a
    symbol no input gives. Plain polynomials (``4096*s0*s1``) compile to Python arithmetic;
    anything with a function in it (torch's FloorDiv, Max) is evaluated by substitution."""
    if not isinstance(size, torch.SymInt):
        value = int(size)
        return lambda *_: value
    import sympy  # a symbolic size's own library; not at import, where every warm start would pay 30 MB

    expr = size.node.expr
    if not expr.free_symbols <= set(symbols):
        return None
    if not expr.atoms(sympy.Function):
        compiled = sympy.lambdify(symbols, expr, modules="math")
        return lambda *values: int(compiled(*values))

    def substituted(*values: int) -> int:
        return int(expr.xreplace({s: sympy.Integer(v) for s, v in zip(symbols, values)}))

    return substituted
