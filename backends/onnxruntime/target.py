"""The ``onnxruntime`` target: run an optimized graph in an ONNX Runtime InferenceSession.

``torch.compile(m, backend="graphopt", options={"target": "onnxruntime", "provider": "cpu"})``.
The graph is exported with graphopt ops as ORT's fused ops (``export.py``) and run through
``session.SessionRunner``. A graph that cannot be exported raises ``UnsupportedOp`` /
``OnnxExportError`` naming the op, and the core's ``lower()`` runs it eagerly instead, with
a warning and a report entry.

Shapes: a torch.compile graph with static shapes is exported once, at compile time, so an
export problem shows up there. A graph with symbolic shapes (dynamo's dynamic=True) is
exported for each new input signature on first use and kept (up to ``MAX_SPECIALIZATIONS``),
since a dynamo graph's SymInt inputs and outputs have no ONNX counterpart.
"""

from __future__ import annotations

import importlib.util
import re
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

REQUIRED_PACKAGES = ("onnxruntime", "onnx", "onnxscript", "onnx_ir")
MAX_SPECIALIZATIONS = 8


def missing_package() -> str | None:
    """The first package this target needs that is not installed, or None."""
    for name in REQUIRED_PACKAGES:
        if importlib.util.find_spec(name) is None:
            return name.replace("_", "-")
    return None


class OnnxRuntimeTarget:
    name = "onnxruntime"

    def unavailable_reason(self, config) -> str | None:
        missing = missing_package()
        if missing:
            return f"needs the Python package {missing!r}: pip install 'graphopt[onnxruntime]'"
        from graphopt.backends.onnxruntime.session import provider_problem

        return provider_problem(config.provider)

    def compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any] | None, config) -> Callable:
        from graphopt.backends.onnxruntime import lowering
        from graphopt.backends.onnxruntime.translations import translation_table

        lowering.check_translations(gm, translation_table())  # name a missing op before any tracing
        if example_inputs is None or _has_symbolic_shapes(gm):
            return _PerSignature(gm, config.provider)
        return _compile_static(gm, list(example_inputs), config.provider)


def _has_symbolic_shapes(gm: fx.GraphModule) -> bool:
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt) or (isinstance(val, torch.Tensor) and any(
                isinstance(s, torch.SymInt) and not s.node.is_constant() for s in val.shape)):
            return True
    return False


def _output_specs(gm: fx.GraphModule) -> list | None:
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


def _compile_static(gm: fx.GraphModule, example_inputs: list, provider: str) -> Callable:
    from graphopt.backends.onnxruntime.export import export_graph
    from graphopt.backends.onnxruntime.session import SessionRunner, create_session

    model = export_graph(gm, example_inputs, dynamic=False)
    try:
        session = create_session(model, provider)
    except Exception as error:
        raise _missing_kernel(error, model, provider) or error
    runner = SessionRunner(session, _output_specs(gm))
    tensor_positions = [i for i, x in enumerate(example_inputs) if isinstance(x, torch.Tensor)]
    plan = model.output_plan
    single = not isinstance(gm.graph.output_node().args[0], (tuple, list))

    def run(*args: Any) -> Any:
        outputs = runner(*[args[i] for i in tensor_positions])
        result = [outputs[p] if isinstance(p, int) else p[1] for p in plan]
        return result[0] if single else tuple(result)

    run.onnx_model = model  # for tests and tools: the exported model behind this callable
    return run


def _missing_kernel(error: Exception, model, provider: str) -> Exception | None:
    """ORT's NOT_IMPLEMENTED "Could not find an implementation for MatMul(13) node" as one line
    that names the fix (most often: the CPU provider has no bfloat16 kernels); else None."""
    from graphopt.backends.onnxruntime.errors import MissingKernel

    found = re.search(r"Could not find an implementation for (\w+)\(\d+\) node", str(error))
    if not found:
        return None
    import onnx_ir as ir

    graph = model.model.graph
    values = [*graph.inputs, *graph.initializers.values(), *(out for node in graph for out in node.outputs)]
    return MissingKernel(found.group(1), provider, any(v.dtype == ir.DataType.BFLOAT16 for v in values))


class _PerSignature:
    """Export and run one static ONNX model per input signature (shapes, dtypes, int values)."""

    def __init__(self, gm: fx.GraphModule, provider: str) -> None:
        self.gm, self.provider = gm, provider
        self.compiled: OrderedDict[tuple, Callable] = OrderedDict()

    def __call__(self, *args: Any) -> Any:
        key = tuple((tuple(a.shape), a.dtype, a.device.type) if isinstance(a, torch.Tensor) else a for a in args)
        fn = self.compiled.get(key)
        if fn is None:
            # In a worker thread: this runs inside aot_autograd's runtime wrapper, whose
            # thread-local dispatch state breaks torch.export (functional tensors leak).
            with ThreadPoolExecutor(max_workers=1) as pool:
                fn = pool.submit(lambda: _compile_static(_specialize(self.gm, args), list(args), self.provider)).result()
            self.compiled[key] = fn
            if len(self.compiled) > MAX_SPECIALIZATIONS:
                self.compiled.popitem(last=False)
        else:
            self.compiled.move_to_end(key)
        return fn(*args)


def _specialize(gm: fx.GraphModule, args: Sequence[Any]) -> fx.GraphModule:
    """``gm`` re-traced with these inputs' concrete sizes: every size is an int again, so
    the lowering and the translations choose ORT ops from static shapes (a one-token query,
    equal sequence lengths) exactly as for a static graph. Fake tensors of the concrete
    shapes (the frozen weights stay real); graphopt ops stay ops; nodes get ``meta["val"]``.
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch.no_grad():
        return make_fx(gm, tracing_mode="fake", _allow_non_fake_inputs=True)(*args)


onnxruntime = OnnxRuntimeTarget()
