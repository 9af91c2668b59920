"""Give ONNX Runtime an in-memory model's weights as OrtValues instead of serializing them,
and let the session compute on those buffers instead of copies of its own.

Serializing a model copies every weight into the protobuf, then into its bytes, and ORT
copies them out again when it parses the bytes: 2.3-3.5 s of the 3.5-4.7 s that opening a
llama-small session took. Here the model is serialized with its large initializers marked
as external data at a location that names no file, and ORT is handed each one as an
OrtValue (``SessionOptions.add_external_initializers``), which it takes in place of reading
the file. A model over protobuf's 2 GB limit needs no temporary files. A Linear's weight,
which the model reads transposed, is handed over as torch holds it, with no transposed copy
(``transposed_weights.py``); that rewrite of the session's bytes is recorded as the ONNX passes
are (``onnx:transposed_weights``), and ``create_session`` keeps the record on the session.

ORT copies external initializers into the graph it loads, and its CPU MatMul kernels then
prepack each float weight into a layout of their own: one more copy of every weight per
session, beside the module's own (under ``torch.compile`` the user's module keeps its
weights). A model compiled as a prefill graph and a decode graph had two; transformers'
``generate`` on Qwen2.5-Coder-0.5B peaked at 10.1 GB where eager stays at 3.9 GB. So each
weight is also given to the session as its own initializer (``SessionOptions.add_initializer``:
the session reads the buffer in place for its whole life, which these OrtValues' holders,
kept on the session, guarantee), the graph's copy is freed once the session exists, and a
model whose only prepacking kernels are float matmuls opens with prepacking off
(``prepacking_pays``). Every session then computes on the module's own buffers: no weight
copy per session, only the graph's while it loads, and not that one for the weights a
``torch.compile`` session takes as inputs instead (``fed_weights.py``). Unpacked float
weights cost nothing at one row (MLAS reads a weight in place for a matrix-vector product:
a decode step measured as fast or faster) and 15-45% on a prefill's MatMuls; a quantized model (``MatMulNBits``
and the other kernels in ``PREPACK_PAYS``) keeps prepacking, which its kernels need for
their speed, and its weights are its own tensors, not the module's. An in-place edit of a
module's weight after the compile now reaches the session, as it reaches eager torch.
"""

from __future__ import annotations

from typing import Any

from graphopt.backends.onnxruntime.onnx_passes import transposed_weights
from graphopt.backends.onnxruntime.runtime import fed_weights

IN_MEMORY = "graphopt-in-memory"  # the external-data location: no file, ORT gets the values
MIN_BYTES = 1024  # smaller initializers stay in the model's bytes
# Kernels whose prepacked layout is what makes them fast (quantized matmuls, convolutions,
# recurrent and attention ops with weights): a model with one keeps ORT's prepacking.
PREPACK_PAYS = frozenset({"MatMulNBits", "MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul",
                          "QLinearMatMul", "MatMulBnb4", "GatherBlockQuantized", "Conv", "ConvTranspose",
                          "QLinearConv", "FusedConv", "NhwcFusedConv", "LSTM", "GRU", "DynamicQuantizeLSTM",
                          "Attention", "QAttention", "MoE", "QMoE"})


def prepacking_pays(graph: Any) -> bool:
    """Whether an onnx_ir ``graph`` (or a subgraph of it) has a kernel in ``PREPACK_PAYS``."""
    import onnx_ir as ir

    return any(node.op_type in PREPACK_PAYS for node in ir.traversal.RecursiveGraphIterator(graph))


def serialize_sharing_weights(model: Any, session_options: Any, feeds: dict | None = None) -> tuple[bytes, list, Any]:
    """``model`` (an onnx_model.OnnxModel) as bytes without its large initializers, which are
    added to ``session_options`` instead, both as the graph's data and as the session's own
    initializers. Returns (the bytes, the OrtValues and the buffers under them, which the
    session reads in place: keep them as long as it lives, and the ``runner.OnnxPassRun`` of
    the rewrite those bytes got: ``onnx:transposed_weights``). Turns prepacking off where it
    does not pay (``prepacking_pays``). The model itself is left as it was.

    ``feeds``: a dict to move the weights that can be graph inputs into (name -> buffer), in a
    graph whose kernels do not prepack (``fed_weights.py``); the caller feeds them at each run."""
    import onnx_ir as ir
    import onnxruntime
    import torch

    from graphopt.backends.onnxruntime.onnx_passes.runner import record_run

    graph = model.model.graph
    graph_inputs = {value.name for value in graph.inputs}
    as_transposes = transposed_weights.transposed_matmul_weights(graph)
    swapped, names, values, arrays, flipped = {}, [], [], [], {}
    for name, value in graph.initializers.items():
        tensor = value.const_value
        if tensor is None or tensor.nbytes < MIN_BYTES or name in graph_inputs:
            continue
        array = tensor.numpy()
        # bfloat16 (an ml_dtypes type) and strings have no OrtValue from numpy; a packed
        # type whose numpy form has other bytes (4-bit) would not match the declared length.
        if array.dtype.kind not in "fiub" or array.nbytes != tensor.nbytes:
            continue
        if not array.flags.c_contiguous and name in as_transposes and array.T.flags.c_contiguous:
            array = array.T  # the weight as torch holds it; its MatMuls read it transposed
            flipped[name] = array.shape
        elif not array.flags.c_contiguous:  # another view: ORT reads row-major buffers
            # torch's copy: numpy copies a transposed matrix 5x slower (llama-small 1.9 s against 0.4)
            view = torch.from_numpy(array)
            array = torch.empty(view.shape, dtype=view.dtype).copy_(view).numpy()
        names.append(name)
        values.append(onnxruntime.OrtValue.ortvalue_from_numpy(array))
        arrays.append(array)
        swapped[name] = tensor
        value.const_value = ir.ExternalTensor(IN_MEMORY, 0, tensor.nbytes, tensor.dtype, shape=tensor.shape,
                                              name=name)
    try:
        proto = model.to_proto()
    finally:
        for name, tensor in swapped.items():
            graph.initializers[name].const_value = tensor
    rewrites = record_run(transposed_weights.NAME,
                          lambda: transposed_weights.multiply_by_transposes(proto.graph, flipped, proto.opset_import),
                          lambda: len(proto.graph.node))
    if feeds is not None and not prepacking_pays(graph):
        fed = fed_weights.feedable(proto.graph, names)
        fed_weights.make_inputs(proto.graph, fed)
        feeds.update((name, array) for name, array in zip(names, arrays) if name in fed)
    loaded = [(name, value) for name, value in zip(names, values) if feeds is None or name not in feeds]
    data = proto.SerializeToString()
    if loaded:
        session_options.add_external_initializers([name for name, _ in loaded], [value for _, value in loaded])
        for name, ortvalue in loaded:
            session_options.add_initializer(name, ortvalue)
        if not prepacking_pays(graph):
            session_options.add_session_config_entry("session.disable_prepacking", "1")
    return data, [arrays, values], rewrites
