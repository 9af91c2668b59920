"""Multiply by a weight's transpose without a transposed copy of the weight.

A Linear's weight is [out, in] in torch; ``x @ W.t()`` exports as ``MatMul(x, B)`` with B the
transposed view, [in, out]. ORT reads row-major buffers, so handing B to a session meant a
contiguous copy of every such weight first (``weights_in_memory.py``), which ORT then copied
again into the session and prepacked: three copies of the weights alive while a session
opened. On SmolLM2 the copies alone were 415-550 MB of the compile's peak.

ONNX Runtime's ``FusedMatMul`` (com.microsoft) takes ``transB=1`` and packs B from the
[out, in] buffer directly, as its MatMul kernel does from [in, out] (one MLAS kernel, the same
prepacked layout, so the same speed: measured equal at 1 and 64 rows). So, in the bytes a CPU
session is made from, and only there:

- an initializer stored as the transposed view of a row-major tensor, read only as the B of
  MatMuls, is handed over as that row-major tensor and those MatMuls become
  ``FusedMatMul(transB=1)``;
- ``MatMul(x, Transpose(W))`` with W a 2-D initializer (a tied LM head reading the embedding
  table) becomes ``FusedMatMul(x, W, transB=1)``, where ORT would otherwise fold the Transpose
  into one more copy of the table.

A MatMul whose output feeds an Add keeps its form: ORT fuses MatMul + Add into Gemm (the bias
in the GEMM's epilogue), which it does not do for FusedMatMul. Only float32 weights are read
this way: FusedMatMul's CPU kernel is float32's (ORT casts around it for other types). Saved files (``graphopt
export``) are not rewritten: they stay plain ONNX for every runtime.

So it is not one of the export's ONNX passes (``runner.OnnxPass``, run on the onnx_ir model):
which weights it may flip is known only while ``weights_in_memory.py`` hands them over (a
weight held as a transposed view), and it rewrites that session's protobuf, never the model.
It is recorded as they are, though: ``runner.record_run`` makes its ``onnx:transposed_weights``
record (matches: the MatMuls made FusedMatMul; ``weights``: the weights the session reads as
they are held, with no transposed copy; ``bytes``: their size, the copies not made). The
record belongs to the session (``session.session_passes``); the target adds it to the graph's
report after the export's passes, and ``graphopt debug --target onnxruntime`` lists it last.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    from graphopt.backends.onnxruntime.onnx_passes.runner import OnnxPassResult

MS_DOMAIN = "com.microsoft"
NAME = "transposed_weights"  # reported as onnx:transposed_weights, beside the export's passes


def transposed_matmul_weights(graph: Any) -> set[str]:
    """Names of the 2-D float32 initializers of an onnx_ir ``graph`` whose every use is the B
    input of a MatMul of this graph (not a subgraph's) whose output no Add reads."""
    import onnx_ir as ir

    names = set()
    for name, value in graph.initializers.items():
        uses, tensor = value.uses(), value.const_value
        if (tensor is None or tensor.dtype != ir.DataType.FLOAT or len(tensor.shape) != 2 or not uses
                or value.is_graph_output() or value.is_graph_input()):
            continue
        if all(_is_plain_matmul(node) and index == 1 and node.graph is graph and not _feeds_add(node)
               for node, index in uses):
            names.add(name)
    return names


def _is_plain_matmul(node: Any) -> bool:
    """An ONNX-domain MatMul (an onnx_ir Node or a NodeProto)."""
    return node.op_type == "MatMul" and node.domain in ("", "ai.onnx")


def _feeds_add(node: Any) -> bool:
    return any(use.op_type == "Add" for out in node.outputs for use, _ in out.uses())


def multiply_by_transposes(graph: Any, flipped: dict[str, tuple[int, ...]], opset_import: Any) -> OnnxPassResult:
    """Rewrite a GraphProto in place: the initializers in ``flipped`` now hold their
    transposes (shape given), so their MatMuls become FusedMatMul(transB=1); and
    MatMul(x, Transpose(W)) of a 2-D initializer W becomes FusedMatMul(x, W, transB=1).
    Returns an ``OnnxPassResult``: how many MatMuls changed, and the ``weights`` read with no
    transposed copy (the flipped ones and those whose Transpose went) and their ``bytes``."""
    from graphopt.backends.onnxruntime.onnx_passes.runner import OnnxPassResult  # here: runner imports torch

    initializers = {t.name: t for t in graph.initializer}
    for name, shape in flipped.items():
        tensor = initializers[name]
        del tensor.dims[:]
        tensor.dims.extend(shape)
    # a value_info naming a flipped initializer would contradict its new dims
    kept = [v for v in graph.value_info if v.name not in flipped]
    del graph.value_info[:]
    graph.value_info.extend(kept)

    readers = defaultdict(list)  # value name -> the nodes of this graph that read it
    for node in graph.node:
        for name in node.input:
            readers[name].append(node)
    transposes = {node.output[0] for node in graph.node if _is_foldable_transpose(node, initializers)}
    producer = {node.output[0]: node for node in graph.node if node.output}

    changed, bypassed = 0, set()  # bypassed: the Transposes a MatMul no longer reads
    for node in graph.node:
        if not _is_plain_matmul(node) or len(node.input) != 2:
            continue
        b = node.input[1]
        if b in flipped:  # every reader of b is such a MatMul (transposed_matmul_weights)
            _to_fused_transposed(node, b)
            changed += 1
        elif b in transposes and not any(r.op_type == "Add" for out in node.output for r in readers[out]):
            _to_fused_transposed(node, producer[b].input[0])
            bypassed.add(b)
            changed += 1
    # A Transpose no one reads any more goes, or ORT would still fold it into a copy.
    read = {name for node in graph.node for name in node.input} | set(subgraph_inputs(graph.node))
    read |= {v.name for v in graph.output}
    gone = {name: producer[name].input[0] for name in transposes if name not in read}
    kept = [node for node in graph.node if not (node.output and node.output[0] in gone)]
    if len(kept) != len(graph.node):
        del graph.node[:]
        graph.node.extend(kept)
    if changed and not any(o.domain == MS_DOMAIN for o in opset_import):
        entry = opset_import.add()
        entry.domain, entry.version = MS_DOMAIN, 1
    # The weights no transposed copy is made of: a Transpose still read by another op is still folded into one.
    still = {producer[name].input[0] for name in transposes if name not in gone}
    uncopied = set(flipped) | {weight for name, weight in gone.items() if name in bypassed and weight not in still}
    return OnnxPassResult(changed, {"weights": len(uncopied),
                                    "bytes": sum(tensor_nbytes(initializers[name]) for name in uncopied)})


def tensor_nbytes(tensor: Any) -> int:
    """A TensorProto's size in bytes, from its dims (its data may lie outside: weights_in_memory)."""
    from onnx import helper

    return math.prod(tensor.dims) * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def _is_foldable_transpose(node: Any, initializers: dict) -> bool:
    from onnx import TensorProto

    if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx") or len(node.input) != 1:
        return False
    source = initializers.get(node.input[0])
    perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
    return (source is not None and source.data_type == TensorProto.FLOAT and len(source.dims) == 2
            and perm in (None, [1, 0]))


def _to_fused_transposed(node: Any, weight: str) -> None:
    from onnx import helper

    node.op_type, node.domain = "FusedMatMul", MS_DOMAIN
    node.input[1] = weight
    node.attribute.append(helper.make_attribute("transB", 1))


def subgraph_inputs(nodes: Iterable[Any]) -> Iterable[str]:
    """Every value name read inside the subgraphs (If / Loop bodies) of ``nodes``."""
    for node in nodes:
        for attribute in node.attribute:
            graphs = list(attribute.graphs) + ([attribute.g] if attribute.HasField("g") else [])
            for sub in graphs:
                for inner in sub.node:
                    yield from inner.input
                yield from subgraph_inputs(sub.node)
