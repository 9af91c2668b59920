"""A compiled graph's callable on its ONNX Runtime session: the graph's tensor inputs (and
its sizes, as 0-d tensors) in, the session's outputs back in the graph's order, sizes the graph
returns computed from its inputs, and outputs laid out in memory as the graph returns them.
Moved out of target.py, which keeps the strategies that decide which session a graph gets."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.fx as fx

from graphopt.backends.onnxruntime.lower.signatures import SizePlan
from graphopt.backends.onnxruntime.runtime.bound_outputs import BoundOutputs, release_arena_options
from graphopt.backends.onnxruntime.runtime.heap_trim import release_after_run


def output_specs(gm: fx.GraphModule) -> list | None:
    """(shape, dtype) of each tensor output when every one is static, else None."""
    outputs = gm.graph.output_node().args[0]
    outputs = outputs if isinstance(outputs, (tuple, list)) else [outputs]
    specs = []
    for out in outputs:
        val = out.meta.get("val") if isinstance(out, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            continue
        if not all(isinstance(s, int) for s in val.shape):
            return None
        specs.append((tuple(val.shape), val.dtype))
    return specs


def graph_runner(gm, model, session, runner, example_inputs: list, plan: SizePlan | None,
            output_plan: list | None = None, bound: BoundOutputs | None = None, release: bool = False) -> Callable:
    """The graph's callable. ``release``: a run at input shapes other than the previous run's
    shrinks the session's arena (a dynamic session with the arena on), into outputs that
    ``bound`` allocates (``bound_outputs.py``). A run that repeats the previous run's shapes
    leaves the arena as it is: shrinking after every run made each one fault its memory back
    in (llama-small at 4x512: 125k page faults, 3.24 against 2.97 s a call), while a shape
    that keeps coming back is worth the memory it keeps (about 420 MB at 4x512) until the
    next shape releases it. After a shrink the C heap's free pages go back too (``heap_trim.py``)."""
    tensor_positions = [i for i, x in enumerate(example_inputs) if isinstance(x, torch.Tensor)]
    scalar_positions = model.scalar_inputs  # after the tensors, as 0-d int64 tensors
    outputs_plan = model.output_plan if output_plan is None else output_plan
    single = not isinstance(gm.graph.output_node().args[0], (tuple, list))
    layouts = output_layouts(gm)
    release = release_arena_options() if release else None
    positions = bound.onnx_positions(outputs_plan, len(runner.output_names)) if bound is not None else None
    previous_shapes: list = [None]

    def run(*args: Any) -> Any:
        tensors = [args[i] for i in tensor_positions]
        tensors += [torch.tensor(int(args[i]), dtype=torch.int64) for i in scalar_positions]
        options = None
        if release is not None:  # a static session has no arena to shrink
            shapes = [tuple(t.shape) for t in tensors]
            options = release if shapes != previous_shapes[0] else None
            previous_shapes[0] = shapes
        into = bound.allocate(positions, args) if positions is not None and runner.takes_numpy(tensors) else None
        # Outputs the arena allocated would pin their regions through the shrink: bind ours.
        started = time.perf_counter()
        outputs = runner.run_into(tensors, into, options) if into is not None else runner(*tensors, run_options=options)
        if options is not None:  # the arena shrank into glibc's heap: hand its free pages back too
            release_after_run(time.perf_counter() - started)
        sizes = plan.sizes(args) if plan is not None and plan.needs_sizes(outputs_plan) else None
        result = [outputs[p] if isinstance(p, int) else plan.output(p[1], sizes) if p[0] == "sym" else p[1]
                  for p in outputs_plan]
        result = [_lay_out(r, order) if order is not None else r for r, order in zip(result, layouts)]
        return result[0] if single else tuple(result)

    run.onnx_model = model  # for tests and tools: the exported model behind this callable
    run.session = session  # one per compiled graph, whatever shapes it serves
    return run


def laid_out_as_session(gm: fx.GraphModule) -> Callable[[Any], Any]:
    """The graph's outputs (from torch) in the layout ``graph_runner`` gives the session's: row-major,
    or the graph's own dim order where ``output_layouts`` names one."""
    layouts = output_layouts(gm)

    def lay_out(outputs: Any) -> Any:
        single = not isinstance(outputs, (tuple, list))
        flat = [outputs] if single else list(outputs)
        flat = [(_lay_out(t, order) if order is not None else t.contiguous()) if isinstance(t, torch.Tensor) else t
                for t, order in zip(flat, layouts + [None] * (len(flat) - len(layouts)))]
        return flat[0] if single else tuple(flat) if isinstance(outputs, tuple) else flat

    return lay_out


def output_layouts(gm: fx.GraphModule) -> list[list[int] | None]:
    """Per graph output: the order of its dims in memory (outermost first) when the graph
    returns it laid out otherwise than row-major, else None.

    ONNX Runtime returns row-major tensors. aot_autograd rebuilds an output that aliases
    an input (a transposed view of it) from the strides of what we return, so a row-major
    result in place of a transposed view would be read with the wrong strides.
    """
    outputs = gm.graph.output_node().args[0]
    outputs = outputs if isinstance(outputs, (tuple, list)) else [outputs]
    layouts = []
    for out in outputs:
        val = out.meta.get("val") if isinstance(out, fx.Node) else None
        layouts.append(_memory_order(val) if isinstance(val, torch.Tensor) else None)
    return layouts


def _memory_order(val: torch.Tensor) -> list[int] | None:
    # A symbolic stride is ordered by its hint: the layout does not change with the size.
    strides = [s.node.hint if isinstance(s, torch.SymInt) else s for s in val.stride()]
    if any(s is None for s in strides):
        return None
    order = sorted(range(val.dim()), key=lambda d: (-strides[d], d))
    return None if order == list(range(val.dim())) else order


def _lay_out(tensor: Any, order: list[int]) -> Any:
    """``tensor`` copied into the memory order ``order`` (same shape and values)."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != len(order):
        return tensor
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return tensor.permute(order).contiguous().permute(inverse)
