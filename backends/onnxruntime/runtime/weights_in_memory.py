"""Give ONNX Runtime an in-memory model's weights as OrtValues instead of serializing them.

Serializing a model copies every weight into the protobuf, then into its bytes, and ORT
copies them out again when it parses the bytes: 2.3-3.5 s of the 3.5-4.7 s that opening a
llama-small session took. Here the model is serialized with its large initializers marked
as external data at a location that names no file, and ORT is handed each one as an
OrtValue (``SessionOptions.add_external_initializers``), which it takes in place of reading
the file. ORT copies that data into the session while it loads the model (its documented
contract: the buffers may be freed once the session exists), so the OrtValues are views of
the weights where they are contiguous and the caller drops them after creating the
session; an in-place edit of a weight afterwards does not reach the session, as before.
llama-small: 4.7 -> 1.2 s to open the session; a model over protobuf's 2 GB limit needs
no temporary files. A Linear's weight, which the model reads transposed, is handed over as
torch holds it, with no transposed copy (``transposed_weights.py``).
"""

from __future__ import annotations

from typing import Any

from graphopt.backends.onnxruntime.onnx_passes.transposed_weights import multiply_by_transposes, transposed_matmul_weights

IN_MEMORY = "graphopt-in-memory"  # the external-data location: no file, ORT gets the values
MIN_BYTES = 1024  # smaller initializers stay in the model's bytes


def serialize_sharing_weights(model: Any, session_options: Any) -> tuple[bytes, list]:
    """``model`` (an export.OnnxModel) as bytes without its large initializers, which are
    added to ``session_options`` instead. Returns (the bytes, the OrtValues and the buffers
    under them, to keep until the session is created). The model itself is left as it was."""
    import onnx_ir as ir
    import onnxruntime
    import torch

    graph = model.model.graph
    graph_inputs = {value.name for value in graph.inputs}
    as_transposes = transposed_matmul_weights(graph)
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
    multiply_by_transposes(proto.graph, flipped, proto.opset_import)
    data = proto.SerializeToString()
    if names:
        session_options.add_external_initializers(names, values)
    return data, [arrays, values]
