"""The exported ONNX model: what it holds, how it is counted and saved, and its weights read
from the checkpoint only when written.

``export.py`` makes an ``OnnxModel`` from an FX graph; everything that holds the model after
that (the target's session, the export tool's files, the decoder cache, benchmarks) reads it
through this class, so what a model is lives apart from how one is made. A weight the frontend
left in the checkpoint (``graphopt/lazy_weights.py``) becomes an initializer that reads its
bytes when the model is saved or a fold asks for it, one tensor at a time: holding them all
would put a second copy of the checkpoint in memory.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from graphopt.backends.onnxruntime.errors import OnnxExportError
from graphopt.backends.onnxruntime.lower import schemas
from graphopt.backends.onnxruntime.onnx_passes.runner import OnnxPassRun

# Protobuf cannot serialize more than 2 GiB in one message: larger models keep weights outside.
LARGE_MODEL_BYTES = 2**31 - 2**26
# Threads writing a model's external data: two keep a core reading weights while one writes.
WRITERS = min(4, os.cpu_count() or 1)
# The ORT ops a translation emits, as op_histogram spells them: one list, in schemas.py.
ORT_FUSED_OPS = schemas.FUSED_OP_NAMES


@dataclass
class OnnxModel:
    """An exported model (``onnx_ir.Model``) and what the caller needs to run it."""

    model: Any  # onnx_ir.Model
    input_names: list[str]
    output_names: list[str]
    # Position of each output of the graph: an ONNX output index, ("const", value), or
    # ("sym", i) for a symbolic size the caller computes from the inputs' sizes at run time.
    output_plan: list[Any] = field(default_factory=list)
    cached_attention: int = 0  # attentions lowered to GroupQueryAttention with past/present
    # "direct" (translated as compiled: direct_export.py) or "traced: <why>" (torch.onnx.export).
    route: str = "traced"
    # Graph inputs (placeholder positions) the model takes after its tensors, as 0-d int64
    # tensors: SymInts that no tensor input's size gives (``signatures.SizePlan.scalars``).
    scalar_inputs: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # how it was made (the frontend's layer stamping, ...)
    # The ONNX-level passes run on it: their report records and near misses (onnx_passes/runner.py).
    passes: OnnxPassRun = field(default_factory=OnnxPassRun)

    def op_histogram(self) -> dict[str, int]:
        """``{"com.microsoft::GroupQueryAttention": 8, "MatMul": 57, ...}`` over the main graph."""
        counts = Counter(f"{n.domain}::{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type
                         for n in self.model.graph)
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    def fused_op_counts(self) -> dict[str, int]:
        return {k: v for k, v in self.op_histogram().items() if k in ORT_FUSED_OPS}

    def initializer_bytes(self) -> int:
        return sum(v.const_value.nbytes for v in self.model.graph.initializers.values() if v.const_value is not None)

    def int4_weights(self) -> dict | None:
        """What MatMulNBits / GatherBlockQuantized made of the weights (None when there are
        none): ``{"matmulnbits", "embeddings", "bytes", "fp32_bytes", "ratio", "float_matmuls"}``.
        ``bytes`` is what ONNX Runtime reads of their initializers, in the dtype each op reads
        (``graphopt.quant.report.onnx_quantized_bytes``: fp16 scales behind a Cast are read as fp32),
        a tied table's codes once; ``fp32_bytes`` the same weights in fp32 (a table padded to
        whole blocks, and not again when it is the head's); ``float_matmuls`` the MatMul /
        Gemm nodes still reading a constant weight."""
        import onnx_ir as ir

        from graphopt.quant.report import constant_behind, onnx_quantized_bytes

        nodes = list(ir.traversal.RecursiveGraphIterator(self.model.graph))  # an If's branches too (int4.py)
        quantized = [n for n in nodes if n.op_type == "MatMulNBits"]
        tables = [n for n in nodes if n.op_type == "GatherBlockQuantized"]
        if not quantized and not tables:
            return None
        fp32_bytes = sum(n.attributes["K"].value * n.attributes["N"].value * 4 for n in quantized)
        heads = {constant_behind(n.inputs[1]).name for n in quantized}
        for node in tables:
            codes = constant_behind(node.inputs[0])
            if codes.name not in heads:  # a tied table's fp32 weight is the head's, counted above
                bits = node.attributes["bits"].value if "bits" in node.attributes else 4
                fp32_bytes += codes.const_value.size * 8 // bits * 4
        stored = onnx_quantized_bytes(self.model)["bytes"]
        float_matmuls = sum(1 for n in nodes if n.op_type in ("MatMul", "Gemm") and len(n.inputs) > 1
                            and constant_behind(n.inputs[1]) is not None)
        return {"matmulnbits": len(quantized), "embeddings": len(tables), "bytes": stored,
                "fp32_bytes": fp32_bytes, "ratio": stored / fp32_bytes, "float_matmuls": float_matmuls}

    def is_large(self) -> bool:
        return self.initializer_bytes() > LARGE_MODEL_BYTES

    def to_proto(self):
        import onnx_ir as ir

        return ir.serde.serialize_model(self.model)

    def to_bytes(self) -> bytes:
        if self.is_large():
            raise OnnxExportError("model is over 2 GB; save it with external data and load it from the file")
        return self.to_proto().SerializeToString()

    def save(self, path: str | os.PathLike, external_data: bool | None = None) -> list[str]:
        """Write the model; returns the files. The weights go to ``<name>.data`` beside it when
        ``external_data`` is true, or (None) when they are over 2 GB, protobuf's limit. Writing
        them outside the protobuf is also several times faster: onnx_ir writes each tensor's
        bytes as they lie, where an inline model is serialized into one message first (SmolLM2-135M's
        fp32 decoder: about 9 s inline, 3.6 s outside). Outside, tensors are written on
        ``WRITERS`` threads, each at its own offset (the same bytes as one writer): a lazy
        weight is read and re-laid out (numpy, no GIL) while another is written."""
        import onnx_ir as ir

        path = os.fspath(path)
        if external_data or (external_data is None and self.is_large()):
            data = os.path.basename(path) + ".data"
            ir.save(self.model, path, external_data=data, max_workers=WRITERS)
            return [path, os.path.join(os.path.dirname(path), data)]
        ir.save(self.model, path)
        return [path]


def read_lazy_weights_when_written(model) -> int:
    """Give every initializer made from a lazy weight (graphopt/lazy_weights.py: a fake tensor
    whose bytes stay in the checkpoint) a tensor that reads them when asked: when the model is
    saved, one initializer at a time, or when a fold needs a small one. Returns how many."""
    import onnx_ir as ir

    from graphopt import lazy_weights

    count = 0
    sources = {}
    for name, value in model.graph.initializers.items():
        raw = getattr(value.const_value, "raw", None)
        if not lazy_weights.is_lazy(raw):
            continue
        source = lazy_weights.source_of(raw)
        if source is None:
            raise OnnxExportError(f"weight {name} has no data: a pass made it from lazy weights without "
                                  "graphopt.lazy_weights.derive")
        value.const_value = ir.LazyTensor(functools.partial(_read_source, source, tuple(raw.shape)),
                                          dtype=value.const_value.dtype, shape=ir.Shape(tuple(raw.shape)), name=name)
        sources[name] = source
        count += 1
    _transpose_when_written(model, sources)
    return count


def _transpose_when_written(model, sources: dict) -> int:
    """``Transpose(W)`` of a lazily read weight (a linear's ``W^T``) becomes an initializer read
    transposed when written: the cleanup's constant folding would otherwise compute every
    weight's transpose at once and hold them all (a float checkpoint's whole model in memory)."""
    import onnx_ir as ir

    done = 0
    for node in list(model.graph):
        weight = node.inputs[0] if node.op_type == "Transpose" and node.domain in ("", "ai.onnx") else None
        if weight is None or weight.name not in sources or node.outputs[0].is_graph_output():
            continue
        tensor = weight.const_value
        perm = node.attributes.get("perm")
        perm = tuple(perm.as_ints()) if perm is not None else tuple(reversed(range(len(tensor.shape))))
        shape = tuple(tensor.shape[i] for i in perm)
        name = f"{weight.name}_transposed"
        read = functools.partial(_read_permuted, sources[weight.name], perm, shape)
        value = ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(tensor.dtype),
                         const_value=ir.LazyTensor(read, dtype=tensor.dtype, shape=ir.Shape(shape), name=name))
        model.graph.register_initializer(value)
        ir.convenience.replace_all_uses_with(node.outputs[0], value)
        model.graph.remove(node, safe=True)
        if not weight.uses():
            model.graph.initializers.pop(weight.name)
        done += 1
    return done


def _read_permuted(source, perm: tuple[int, ...], shape: tuple[int, ...]):
    import onnx_ir as ir

    tensor = source.load().permute(perm).contiguous()
    if tuple(tensor.shape) != shape:
        raise OnnxExportError(f"a lazy weight read as {tuple(tensor.shape)}, declared {shape}")
    return ir.Tensor(tensor.numpy())


@contextlib.contextmanager
def lazy_weights_as_stubs(model):
    """``model`` (onnx_ir) with each lazily read initializer standing as an external-data
    reference to no file, for code that serializes the graph without needing the weights
    (a subgraph extracted from it): serializing would read every one of them."""
    import onnx_ir as ir

    swapped = {}
    for name, value in model.graph.initializers.items():
        tensor = value.const_value
        if isinstance(tensor, ir.LazyTensor):
            swapped[name] = tensor
            value.const_value = ir.ExternalTensor("graphopt-lazy-weight", 0, tensor.nbytes, tensor.dtype,
                                                  shape=tensor.shape, name=name)
    try:
        yield model
    finally:
        for name, tensor in swapped.items():
            model.graph.initializers[name].const_value = tensor


def _read_source(source, shape: tuple[int, ...]):
    import onnx_ir as ir

    tensor = source.load()
    if tuple(tensor.shape) != shape:
        raise OnnxExportError(f"a lazy weight read as {tuple(tensor.shape)}, declared {shape}")
    return ir.Tensor(tensor.contiguous().numpy())
