"""ONNX Runtime sessions per execution provider, and running them on torch tensors.

Tensors cross without copies:
- CPU tensors of numpy dtypes go through ``session.run`` as numpy views (ORT reads the
  buffers in place; the numpy arrays it returns own ORT's output buffers, and
  ``torch.from_numpy`` wraps them). On this machine that is also the fastest call: about
  17 us per run against 21 us for an IOBinding of raw pointers and 44 us through DLPack.
- Anything else (GPU tensors, bfloat16, which numpy lacks) goes through IOBinding: inputs
  are bound by DLPack in place, outputs are written into torch tensors allocated on the
  input device when the graph's output shapes are static, or allocated by ORT and handed
  to torch by DLPack when they are not.
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any, Sequence

from graphopt.backends.onnxruntime.errors import ProviderUnavailable
if TYPE_CHECKING:
    import torch
from graphopt.backends.onnxruntime.runtime.weights_in_memory import serialize_sharing_weights

# provider option value -> (ORT execution provider, the package that ships it)
PROVIDERS: dict[str, tuple[str, str]] = {
    "cpu": ("CPUExecutionProvider", "onnxruntime"),
    "cuda": ("CUDAExecutionProvider", "onnxruntime-gpu"),
    "rocm": ("ROCMExecutionProvider", "onnxruntime-rocm"),
    "migraphx": ("MIGraphXExecutionProvider", "onnxruntime-migraphx"),
    "tensorrt": ("TensorrtExecutionProvider", "onnxruntime-gpu"),
}
# Torch dtypes that numpy holds as they are (SessionRunner hands those over as numpy views);
# by name, so that opening a session imports no torch.
NUMPY_DTYPE_NAMES = ("float32", "float16", "float64", "int64", "int32", "int8", "uint8", "bool", "int16")


def numpy_holds(dtype: "torch.dtype") -> bool:
    return str(dtype).removeprefix("torch.") in NUMPY_DTYPE_NAMES


def provider_problem(provider: str) -> str | None:
    """None when ``provider`` can run here, else one line naming the fix."""
    import onnxruntime

    if provider not in PROVIDERS:
        return f"unknown provider {provider!r}; choose one of: {', '.join(PROVIDERS)}"
    ep, package = PROVIDERS[provider]
    if ep in onnxruntime.get_available_providers():
        return None
    if provider == "tensorrt":
        return "provider tensorrt needs onnxruntime-gpu and TensorRT: pip install onnxruntime-gpu tensorrt"
    return f"provider {provider} needs {package}: pip install {package}"


def create_session(model: Any, provider: str = "cpu", *, threads: int | None = None, spin: bool = False,
                   profile_prefix: str | None = None, options: Any = None, arena: bool = True,
                   feed_weights: bool = False):
    """An InferenceSession for an OnnxModel, serialized bytes or a path, on ``provider``.

    ``spin=False`` (the default) stops ORT's intra-op threads from busy-waiting after each
    run. A spinning pool takes the cores from whatever runs next on them: torch's threads
    between graphs of a torch.compile'd model, or the other session of a prefill/decode
    pair. On this 2-core machine, with llama-small, turning it off took a prefill from
    316 to 250 ms and a decode step from 63.8 to 56.0 ms (two sessions taking turns).
    graphopt.generate's in-place decoder is one session stepped alone with torch kept off
    the cores, and spins (backends/onnxruntime/decoder/decoder.py).

    ``arena=False`` turns ORT's CPU memory arena off. The arena keeps every block it ever
    grew to, so a model with dynamic axes either has it off or shrinks it after each run with
    its outputs outside it (``bound_outputs.py``); ``session._graphopt_arena`` says which.

    An in-memory model (onnx_model.OnnxModel) on the CPU keeps its weights out of the bytes ORT
    parses: they are handed over as OrtValues that the session reads in place, with no copy
    of its own (``weights_in_memory.py``), so a model of any size loads without files. On
    other providers a model over 2 GB is written to a temporary folder with external data and
    loaded from there (protobuf cannot hold it in memory); the folder lives as long as the
    session.

    ``feed_weights`` (an in-memory model on the CPU): the large float weights that lose nothing
    as graph inputs become inputs, so opening the session copies none of them
    (``fed_weights.py``); ``SessionRunner`` feeds them at every run (``session._graphopt_feeds``).
    Only for callers that run the session through a ``SessionRunner``.
    """
    import onnxruntime

    problem = provider_problem(provider)
    if problem:
        raise ProviderUnavailable(problem)
    session_options = options or onnxruntime.SessionOptions()
    session_options.log_severity_level = 3  # ORT's warnings about unused initializers are noise here
    if threads:
        session_options.intra_op_num_threads = threads
    if not arena:
        session_options.enable_cpu_mem_arena = False
    # Said either way: ORT's default (spinning) is not what most of graphopt's sessions want.
    session_options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    if profile_prefix:
        session_options.enable_profiling = True
        session_options.profile_file_prefix = profile_prefix
    ep = PROVIDERS[provider][0]
    providers = [ep] if provider == "cpu" else [ep, "CPUExecutionProvider"]
    keepalive = None
    source: Any = model
    handed_over = None  # weights the session reads in place: they live as long as it does
    rewrites = None  # what its bytes got that the model did not (transposed_weights.py)
    feeds = {} if feed_weights else None  # weights the session takes as inputs at every run
    if hasattr(model, "to_bytes") and provider == "cpu":  # other providers: not tried on a device yet
        source, handed_over, rewrites = serialize_sharing_weights(model, session_options, feeds)
    elif hasattr(model, "to_bytes"):
        if model.is_large():
            keepalive = tempfile.TemporaryDirectory(prefix="graphopt-ort-")
            source = os.path.join(keepalive.name, "model.onnx")
            model.save(source)
        else:
            source = model.to_bytes()
    try:
        session = onnxruntime.InferenceSession(source, sess_options=session_options, providers=providers)
    except Exception as error:  # every caller (compile, generate's decoders, export) gets one clear line
        raise missing_kernel(error, model, provider) or error
    # The Python session keeps the model bytes it was made from, only to rebuild itself in
    # set_providers(), which graphopt never calls: a second copy of every weight for the
    # session's whole life (600 MB on llama-small). The C++ session has its own copy.
    if getattr(session, "_model_bytes", None) is not None:
        session._model_bytes = None  # noqa: SLF001
    if ep not in session.get_providers():
        raise ProviderUnavailable(f"provider {provider} is installed but did not start (no device?); "
                                  f"use provider=cpu or check the {PROVIDERS[provider][1]} install")
    session._graphopt_keepalive = keepalive  # noqa: SLF001  (the external-data folder)
    session._graphopt_weights = handed_over  # noqa: SLF001  (the buffers it computes on)
    session._graphopt_arena = arena  # noqa: SLF001
    session._graphopt_passes = rewrites  # noqa: SLF001  (session_passes)
    session._graphopt_feeds = feeds or {}  # noqa: SLF001  (SessionRunner feeds them)
    return session


def session_passes(session: Any):
    """The ONNX passes run on the bytes ``session`` was made from, not on its model
    (``onnx:transposed_weights`` for an in-memory model on the CPU), as a ``runner.OnnxPassRun``:
    the caller adds them to the graph's report after the export's. Empty for a session made from
    bytes or a file, which is made from them as they are."""
    from graphopt.backends.onnxruntime.onnx_passes.runner import OnnxPassRun

    return getattr(session, "_graphopt_passes", None) or OnnxPassRun()


class SessionRunner:
    """Calls a session with torch tensors and returns torch tensors, in ONNX output order.

    ``output_specs``: (shape, dtype) of each output when all are static, so IOBinding can
    write straight into preallocated torch tensors; None to let ORT allocate.
    """

    def __init__(self, session, output_specs: Sequence[tuple[tuple[int, ...], "torch.dtype"]] | None = None) -> None:
        self.session = session
        # The weights the session takes as inputs (create_session's feed_weights), fed at every run.
        self.weights: dict[str, Any] = getattr(session, "_graphopt_feeds", None) or {}
        self.input_names = [i.name for i in session.get_inputs() if i.name not in self.weights]
        self.output_names = [o.name for o in session.get_outputs()]
        self.output_specs = list(output_specs) if output_specs is not None else None
        self.cpu_only = session.get_providers()[0] == "CPUExecutionProvider"

    def __call__(self, *tensors: torch.Tensor, run_options: Any = None) -> list[torch.Tensor]:
        import torch

        if len(tensors) != len(self.input_names):
            raise ValueError(f"the ONNX model takes {len(self.input_names)} inputs, got {len(tensors)}")
        tensors = tuple(t.contiguous() for t in tensors)
        if self.cpu_only and self.takes_numpy(tensors):
            feeds = dict(self.weights)
            feeds.update((name, t.numpy()) for name, t in zip(self.input_names, tensors))
            return [torch.from_numpy(out) for out in self.session.run(None, feeds, run_options)]
        return self._run_bound(tensors, run_options)

    @staticmethod
    def takes_numpy(tensors: Sequence[torch.Tensor]) -> bool:
        return all(t.device.type == "cpu" and numpy_holds(t.dtype) for t in tensors)

    def run_into(self, tensors: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                 run_options: Any = None) -> list[torch.Tensor]:
        """Run on CPU tensors, writing into ``outputs`` (allocated by the caller with the
        outputs' shapes and dtypes); ``run_options`` for the run (an arena shrinkage)."""
        binding = self._binding()
        for name, t in zip(self.input_names, tensors):
            binding.bind_cpu_input(name, t.contiguous().numpy())
        for name, out in zip(self.output_names, outputs):
            binding.bind_output(name, "cpu", 0, out.numpy().dtype, list(out.shape), out.data_ptr())
        self.session.run_with_iobinding(binding, run_options)
        return list(outputs)

    def _binding(self):
        """A new IOBinding (one per run: a runner may be called from several threads) with the weights bound."""
        binding = self.session.io_binding()
        for name, array in self.weights.items():
            binding.bind_cpu_input(name, array)
        return binding

    def _run_bound(self, tensors: Sequence[torch.Tensor], run_options: Any = None) -> list[torch.Tensor]:
        import onnxruntime
        import torch
        from onnxruntime.capi import onnxruntime_pybind11_state as ort_c

        def as_ortvalue(t: torch.Tensor):
            return onnxruntime.OrtValue(ort_c.OrtValue.from_dlpack(t.__dlpack__()))

        binding = self._binding()
        for name, t in zip(self.input_names, tensors):
            binding.bind_ortvalue_input(name, as_ortvalue(t))
        device = tensors[0].device if tensors else torch.device("cpu")
        if self.output_specs is not None:
            outputs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self.output_specs]
            for name, out in zip(self.output_names, outputs):
                binding.bind_ortvalue_output(name, as_ortvalue(out))
            self.session.run_with_iobinding(binding, run_options)
            return outputs
        for name in self.output_names:
            binding.bind_output(name, "cuda" if device.type == "cuda" else "cpu", device.index or 0)
        self.session.run_with_iobinding(binding, run_options)
        return [torch.from_dlpack(v._ortvalue) for v in binding.get_outputs()]  # noqa: SLF001


def missing_kernel(error: Exception, model: Any, provider: str) -> Exception | None:
    """ORT's NOT_IMPLEMENTED "Could not find an implementation for MatMul(13) node" as one line
    that names the fix (most often: the CPU provider has no bfloat16 kernels); else None.
    ``model``: an OnnxModel, or the path of a .onnx file (read without its external weights)."""
    import math
    import re

    import onnx_ir as ir

    from graphopt.backends.onnxruntime.errors import MissingKernel

    found = re.search(r"Could not find an implementation for (\w+)\(\d+\) node", str(error))
    if not found:
        return None
    try:
        graph = model.model.graph if hasattr(model, "model") else ir.from_proto(_load_proto(model)).graph
    except Exception:  # noqa: BLE001  (an unreadable model: ORT's own message stays)
        return None
    weights = list(graph.initializers.values())
    computed = [out for node in graph for out in node.outputs]
    bf16 = lambda values: any(v.dtype == ir.DataType.BFLOAT16 for v in values)  # noqa: E731
    # The model's dtype is its inputs' and its largest weight's; a small bf16 constant (a
    # folded ALiBi slope table) is the model's own code casting, which model.float() keeps.
    largest = max(weights, key=lambda v: math.prod(v.shape) if v.shape is not None and v.shape.is_static() else 0,
                  default=None)
    model_bf16 = bf16(graph.inputs) or (largest is not None and largest.dtype == ir.DataType.BFLOAT16)
    any_bf16 = model_bf16 or bf16(weights) or bf16(computed)
    return MissingKernel(found.group(1), provider, any_bf16, in_code=any_bf16 and not model_bf16)


def _load_proto(path: Any):
    import onnx

    return onnx.load(str(path), load_external_data=False)
