"""The ``triton`` target: graphopt ops run as our Triton kernels, the rest through Inductor.

``torch.compile(m, backend="graphopt", options={"target": "triton"})``. In a copy of the
optimized graph every graphopt op with a kernel (registry.lowered_ops) is retargeted to
its ``graphopt_triton::`` twin (ops.py), whose implementation launches the kernel; ops
with no kernel keep their reference implementation, and the report's notes say which.
The rest of the graph is compiled by Inductor, which emits its own Triton code for the
GPU and calls our ops as extern kernels, or runs eagerly with ``inductor=False`` (or when
Inductor fails on the graph: the kernels are kept and a note says why, unless
``fallback="error"``).

Where it runs:
- a CUDA or ROCm build of torch with a GPU present (``torch.version.hip`` tells AMD
  from NVIDIA; the kernels pick that vendor's autotune configs themselves);
- anywhere with ``TRITON_INTERPRET=1``: the kernels run in triton's interpreter, on CPU
  tensors too, and the rest of the graph runs eagerly (Inductor would compile it for the
  CPU, which is not what this mode tests). This is how the target is tested without a GPU.
Elsewhere ``unavailable_reason`` says so in one line and the core falls back to eager.
"""

from __future__ import annotations

import importlib.util
import logging
from collections import Counter
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from graphopt import ir
from graphopt import report as reports
from graphopt.config import fall_back
from graphopt.errors import GraphoptError
from graphopt.ops import op_name
from graphopt.targets import Compiled

from . import builds

log = logging.getLogger("graphopt")

NO_GPU = ("no CUDA or ROCm GPU: Triton kernels need one "
          "(TRITON_INTERPRET=1 runs them on the CPU for testing)")
NO_TRITON = "needs the Python package 'triton': pip install 'graphopt[triton]'"

# Mutating ops reach a functional graph wrapped in these; their first argument is the op.
_FUNCTIONALIZED = tuple(
    hop for hop in (getattr(torch.ops.higher_order, n, None) for n in ("auto_functionalized",
                                                                      "auto_functionalized_v2"))
    if hop is not None)


def interpreting() -> bool:
    """TRITON_INTERPRET=1, read the way ``triton.jit`` reads it."""
    from triton import knobs

    return bool(knobs.runtime.interpret)


def gpu_vendor() -> str | None:
    """``"rocm"`` or ``"cuda"`` when torch sees a GPU, else None."""
    if not torch.cuda.is_available():
        return None
    return "rocm" if torch.version.hip else "cuda"


class TritonTarget:
    name = "triton"

    def unavailable_reason(self, config) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return NO_TRITON
        if gpu_vendor() is None and not interpreting():
            return NO_GPU
        return None

    def compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any] | None, config) -> Compiled:
        interpret = interpreting()
        if not interpret and not _on_gpu(gm, example_inputs):
            raise GraphoptError("the graph's tensors are on the CPU; the triton target needs them on the GPU "
                                "(move the model and its inputs with .to('cuda'))")
        lowered, done, kept = retarget(gm, runnable=None if interpret else _on_gpu_node)
        report = reports.current_report()
        if not interpret:  # kernels compile at their first launch: each is a build of this graph
            builds.install()
        notes = lowering_notes(done, kept)
        vendor = gpu_vendor()
        if vendor is not None:  # the kernels pick that vendor's autotune configs (_common.is_hip)
            notes.append(f"triton: {'ROCm (AMD, wavefront 64)' if vendor == 'rocm' else 'CUDA (NVIDIA, warp 32)'} "
                         "build of torch")
        compiled: Callable = lowered
        if interpret:
            notes.append("triton: TRITON_INTERPRET=1: kernels run in the interpreter, the rest of the graph eagerly")
        elif not getattr(config, "inductor", True):
            notes.append("triton: inductor=False: the rest of the graph runs eagerly")
        else:
            try:
                compiled = compile_with_inductor(lowered, example_inputs)
                notes.append("triton: the rest of the graph compiled by Inductor")
            except Exception as error:  # Inductor's failure need not cost the Triton kernels
                reason = fall_back(config, error, "Inductor", None, raise_as=None)  # noted below
                notes.append(f"triton: Inductor failed ({reason}); the rest of the graph runs eagerly")
        for note in notes:
            log.info("graphopt: %s", note)
        return Compiled(_running_for(compiled, lowered, report), notes)


def retarget(gm: fx.GraphModule, runnable: Callable[[fx.Node], bool] | None = None
             ) -> tuple[fx.GraphModule, Counter, Counter]:
    """A copy of ``gm`` with each graphopt op that has a kernel (and passes ``runnable``)
    calling its Triton op. Returns (copy, lowered op counts, kept op counts with reasons)."""
    from . import ops

    lowered = ir.copy_graph_module(gm)
    done, kept = Counter(), Counter()
    for node in lowered.graph.nodes:
        if node.op != "call_function":
            continue
        wrapped = node.target in _FUNCTIONALIZED
        name = op_name(node.args[0] if wrapped and node.args else node.target)
        if name is None:
            continue
        twin = ops.triton_op(name)
        if twin is None:
            kept[(name, "no Triton kernel")] += 1
            continue
        if runnable is not None and not runnable(node):
            kept[(name, "inputs not on the GPU")] += 1
            continue
        if wrapped:
            node.args = (twin, *node.args[1:])
        else:
            node.target = twin
        done[name] += 1
    lowered.recompile()
    return lowered, done, kept


def lowering_notes(done: Counter, kept: Counter) -> list[str]:
    notes = []
    if not done and not kept:
        notes.append("triton: no graphopt op in this graph; nothing runs as a Triton kernel")
    if done:
        notes.append("triton: Triton kernels for " + ", ".join(f"{op} x{n}" for op, n in sorted(done.items())))
    for (op, why), n in sorted(kept.items()):
        notes.append(f"triton: {op} x{n} keeps its reference implementation ({why})")
    return notes


def compile_with_inductor(gm: fx.GraphModule, example_inputs: Sequence[Any] | None) -> Callable:
    """Inductor on an ATen graph that is already functional and frozen (get_attr weights).

    ``compile_fx`` (not ``compile_fx_inner``) because it re-runs aot_autograd: that
    functionalizes an in-place ``kv_cache_update`` (auto_functionalized + a copy back,
    which Inductor re-inplaces), so reads of the cache after it stay after it. Without
    concrete inputs (symbolic shapes) the placeholders' fake values stand in.
    """
    from torch._inductor import compile_fx

    if example_inputs is None:
        example_inputs = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    return compile_fx.compile_fx(gm, list(example_inputs))


def _tensors(value: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    fx.node.map_aggregate(value, lambda v: out.append(v) if isinstance(v, torch.Tensor) else v)
    return out


def _on_gpu(gm: fx.GraphModule, example_inputs: Sequence[Any] | None) -> bool:
    """Whether any graph input or frozen weight lives on a GPU."""
    tensors = _tensors(list(example_inputs or []))
    tensors += [t for n in gm.graph.nodes if n.op == "get_attr"
                for t in _tensors(getattr(gm, n.target, None))]
    tensors += [t for n in gm.graph.nodes if n.op == "placeholder" for t in _tensors(n.meta.get("val"))]
    return any(t.device.type == "cuda" for t in tensors)


def _on_gpu_node(node: fx.Node) -> bool:
    """Whether every tensor a node reads lives on a GPU (its fake values carry the device)."""
    vals = [a.meta.get("val") for a in node.all_input_nodes]
    tensors = [t for v in vals for t in _tensors(v)]
    return bool(tensors) and all(t.device.type == "cuda" for t in tensors)


def _running_for(compiled: Callable, lowered: fx.GraphModule, report=None) -> Callable:
    """``compiled`` carrying ``lowered_graph`` (the retargeted graph, for tools and tests);
    kernels it compiles while running are builds in ``report``."""
    def run(*args: Any) -> Any:
        with builds.running_for(report):
            return compiled(*args)

    run.lowered_graph = lowered
    return run


triton = TritonTarget()
