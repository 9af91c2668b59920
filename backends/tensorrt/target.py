"""The ``tensorrt`` target: an optimized graph as TensorRT engines, through torch-tensorrt.

``torch.compile(m, backend="graphopt", options={"target": "tensorrt"})`` on an NVIDIA GPU.
TensorRT knows no graphopt op, so each is first replaced by the ATen ops of its reference
(``graphopt/ops/decompose.py``, which the onnxruntime target shares): TensorRT then fuses the
standard ops itself, and nothing is left for torch-tensorrt to run in PyTorch between engines.
The decomposed graph goes through ``torch.export`` to ``torch_tensorrt.dynamo.compile``.

Precision follows the graph: torch-tensorrt >= 2.11 builds strongly typed engines, so each
layer runs in the dtype the graph (traced from the example inputs) gives it. We do not pass
``enabled_precisions``: with explicit typing torch-tensorrt rejects it. What we do set is
what eager would do on the same GPU: no TF32 for float32 unless torch allows it, and float32
accumulation for float16 GEMMs (cuBLAS's default).

Not here yet, each a one-line fallback to eager: symbolic shapes (use ``dynamic=False``),
``graphopt.int4_linear`` (see INT4_UNSUPPORTED) and the in-place ``kv_cache_update`` of a
functionalized graph.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.errors import GraphoptError, TargetUnavailable
from graphopt.ops import op_name
from graphopt.ops.decompose import decompose_graphopt_ops
from graphopt.targets import Compiled


# Each names torch-tensorrt itself: some callers (graphopt fuzz) show a reason without its target.
NO_NVIDIA_GPU = ("torch-tensorrt needs an NVIDIA GPU and a CUDA build of torch; torch sees none here: "
                 "use target='onnxruntime' on the CPU, or 'triton' on AMD GPUs")
ROCM_BUILD = ("torch-tensorrt runs on NVIDIA GPUs only and this is a ROCm (AMD) build of torch: "
              "use target='triton' on AMD GPUs")
NO_TORCH_TENSORRT = ("needs torch-tensorrt, which is not installed: pip install 'graphopt[tensorrt]' "
                     "(NVIDIA's wheels, built for one torch version: match yours)")
INT4_UNSUPPORTED = ("target 'tensorrt' cannot run graphopt.int4_linear: torch-tensorrt's INT4 needs "
                    "NVIDIA ModelOpt-quantized modules; use target='onnxruntime' (MatMulNBits) or "
                    "'triton' (fused INT4 GEMM) for INT4, or leave int4 off")


class TensorRTTarget:
    name = "tensorrt"

    def unavailable_reason(self, config) -> str | None:
        # The GPU first: without one, installing torch-tensorrt would not help.
        if not torch.cuda.is_available():
            return NO_NVIDIA_GPU
        if getattr(torch.version, "hip", None):
            return ROCM_BUILD
        if importlib.util.find_spec("torch_tensorrt") is None:  # finds, does not import
            return NO_TORCH_TENSORRT
        return None

    def compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any] | None, config) -> Compiled:
        problem = int4_problem(gm)
        if problem:
            raise TargetUnavailable(problem)
        if example_inputs is None or any(isinstance(x, torch.SymInt) for x in example_inputs):
            raise GraphoptError("target 'tensorrt' compiles static shapes only and this graph's sizes are "
                                "symbolic; use torch.compile(..., dynamic=False)")
        example_inputs = list(example_inputs)
        if not _on_gpu(gm, example_inputs):
            raise GraphoptError("the graph's tensors are on the CPU; the tensorrt target needs them on the GPU "
                                "(move the model and its inputs with .to('cuda'))")
        try:
            import torch_tensorrt
        except Exception as error:  # installed, but built for another torch: the usual way it breaks
            first_line = (str(error).splitlines() or [""])[0]
            raise GraphoptError(f"torch-tensorrt is installed but does not import ({type(error).__name__}: "
                                f"{first_line}); install the build made for torch {torch.__version__}") from error

        decomposed_ops = Counter(ir.target_name(n.target) for n in gm.graph.nodes
                                 if n.op == "call_function" and op_name(n.target))
        lowered = decompose_graphopt_ops(ir.copy_graph_module(gm))
        left = sorted(filter(None, (_graphopt_op_in(n) for n in lowered.graph.nodes)))
        if left:  # kv_cache_update inside auto_functionalized: a mutation with no reference to inline
            raise GraphoptError(f"target 'tensorrt' cannot lower {', '.join(left)} inside a functionalized "
                                "mutation; use target='triton' or 'eager' for this graph")

        wrapper = _TensorsOnly(lowered, example_inputs)
        tensors = tuple(x for x in example_inputs if isinstance(x, torch.Tensor))
        with torch.no_grad():
            program = torch.export.export(wrapper, tensors)
        precision = precision_of(lowered, tensors)
        engine = torch_tensorrt.dynamo.compile(program, arg_inputs=list(tensors), **precision_settings(precision))

        notes = [f"tensorrt: {precision_note(precision)}"]
        if decomposed_ops:
            notes.append("tensorrt: decomposed to ATen for TensorRT: "
                         + ", ".join(f"{op} x{n}" for op, n in sorted(decomposed_ops.items())))
        return Compiled(_runner(engine, example_inputs, lowered), notes)


def int4_problem(gm: fx.GraphModule) -> str | None:
    """INT4_UNSUPPORTED when ``gm`` calls graphopt.int4_linear, else None.

    torch-tensorrt's weight-only INT4 path takes ModelOpt's quantized modules, not our
    MatMulNBits-format weights; decomposing would dequantize every weight to full size
    each call, which defeats the point of INT4.
    """
    for node in gm.graph.nodes:
        if node.op == "call_function" and op_name(node.target) == "graphopt.int4_linear":
            return INT4_UNSUPPORTED
    return None


def precision_of(gm: fx.GraphModule, tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """The floating dtype the engine computes in: the floating inputs' (promoted), else the
    frozen weights' (a language model takes int64 token ids), else float32."""
    floats = [t.dtype for t in tensors if t.is_floating_point()]
    if not floats:
        weights = (ir.get_constant(n) for n in gm.graph.nodes if n.op == "get_attr")
        floats = [w.dtype for w in weights if w is not None and w.is_floating_point()]
    dtype = floats[0] if floats else torch.float32
    for other in floats[1:]:
        dtype = torch.promote_types(dtype, other)
    return dtype


def precision_settings(precision: torch.dtype) -> dict[str, Any]:
    """torch_tensorrt.dynamo.compile keywords that make the engine compute as eager would."""
    if precision == torch.float32:
        # TF32 rounds fp32 GEMM inputs to 10 mantissa bits; eager allows it only when asked.
        return {"disable_tf32": torch.get_float32_matmul_precision() == "highest"}
    if precision == torch.float16:
        return {"use_fp32_acc": True}  # fp16 GEMMs accumulate in fp32 in eager (cuBLAS)
    return {}


def precision_note(precision: torch.dtype) -> str:
    settings = precision_settings(precision)
    detail = {"disable_tf32": "TF32 off", "use_fp32_acc": "fp32 accumulation"}
    extras = [text for key, text in detail.items() if settings.get(key)]
    return f"strongly typed engine in {str(precision).removeprefix('torch.')}" + (
        f" ({', '.join(extras)})" if extras else "")


def _graphopt_op_in(node: fx.Node) -> str | None:
    """The graphopt op a node calls, directly or wrapped (auto_functionalized's first argument)."""
    if node.op != "call_function":
        return None
    return op_name(node.target) or next(filter(None, (op_name(a) for a in node.args)), None)


class _TensorsOnly(torch.nn.Module):
    """The graph with its non-tensor inputs fixed (a static dynamo graph's ints) and its
    non-tensor outputs left out: an engine takes and returns tensors only."""

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
        super().__init__()
        self.gm = gm
        self.fixed = {i: v for i, v in enumerate(example_inputs) if not isinstance(v, torch.Tensor)}
        self.count = len(example_inputs)

    def forward(self, *tensors: torch.Tensor):
        it = iter(tensors)
        outputs = self.gm(*[self.fixed[i] if i in self.fixed else next(it) for i in range(self.count)])
        return tuple(v for v in _flat(outputs) if isinstance(v, torch.Tensor))


def _flat(outputs: Any) -> list:
    return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]


def _runner(engine: Callable, example_inputs: list, lowered: fx.GraphModule) -> Callable:
    """A callable with the graph's own signature and output structure around ``engine``."""
    output = lowered.graph.output_node().args[0]
    single = not isinstance(output, (tuple, list))
    plan = [_plan_entry(n) for n in _flat(output)]
    positions = [i for i, x in enumerate(example_inputs) if isinstance(x, torch.Tensor)]

    def run(*args: Any) -> Any:
        produced = iter(_flat(engine(*[args[i] for i in positions])))
        result = [next(produced) if p is _FROM_ENGINE else p for p in plan]
        return result[0] if single else tuple(result)

    run.lowered_graph = lowered  # the decomposed graph, for tools and tests
    return run


_FROM_ENGINE = object()


def _plan_entry(out: Any) -> Any:
    """Where one graph output comes from: the engine's next tensor, or a constant (a
    static dynamo graph returns sizes as ints)."""
    if not isinstance(out, fx.Node):
        return out
    val = out.meta.get("val")
    if val is None or isinstance(val, torch.Tensor):
        return _FROM_ENGINE
    return int(val) if isinstance(val, torch.SymInt) else val


def _on_gpu(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> bool:
    """Whether any graph input or frozen weight lives on a CUDA device."""
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    tensors += [t for t in (ir.get_constant(n) for n in gm.graph.nodes if n.op == "get_attr") if t is not None]
    return any(t.device.type == "cuda" for t in tensors)


tensorrt = TensorRTTarget()
