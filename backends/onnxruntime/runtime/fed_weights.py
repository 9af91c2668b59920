"""Large float weights fed to a session at each run instead of loaded with it, so that opening
the session copies none of them.

ONNX Runtime copies every initializer into the graph it loads, one handed over as an OrtValue
too (``weights_in_memory.py``): the session then computes on the module's buffer and frees the
copy once it is open, but while it opens the process holds the module's weights and ORT's
copy of all of them. Under ``torch.compile`` that copy was the compile's peak: SmolLM2-135M
(513 MB of fp32 weights) rose by 780 MB while its first session opened, to 2.2x eager's
peak. A graph input is never copied: ORT reads the caller's buffer in place at every run,
which is what the session did with the handed-over initializer anyway.

What an input loses against an initializer is what ORT does with constants while it loads:
constant folding and prepacking. So only weights that neither would touch are fed: at least
``FED_MIN_BYTES`` (norm scales and other small tensors stay initializers, which some fusions
want), read only by nodes that also read a computed value (no reader could have been folded),
not read inside a subgraph, and only in graphs whose kernels do not prepack (a quantized
graph's weights are its own tensors, and its kernels need them packed:
``weights_in_memory.prepacking_pays``). ``session.SessionRunner`` feeds them with every run.
"""

from __future__ import annotations

from typing import Any, Iterable

from graphopt.backends.onnxruntime.onnx_passes.transposed_weights import subgraph_inputs, tensor_nbytes

FED_MIN_BYTES = 1 << 20  # a weight matrix; smaller tensors are not worth an input


def feedable(graph: Any, candidates: Iterable[str]) -> set[str]:
    """The names in ``candidates`` (initializers of the GraphProto ``graph``) that can become
    inputs with nothing lost: every reader also reads a value computed at run time."""
    constants = {t.name for t in graph.initializer} | {""}
    for node in graph.node:  # topological order: a node of constants only is one ORT folds
        if node.op_type == "Constant" or (node.input and all(name in constants for name in node.input)):
            constants.update(node.output)
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    inside = set(subgraph_inputs(graph.node))
    outputs = {v.name for v in graph.output}
    sizes = {t.name: tensor_nbytes(t) for t in graph.initializer}
    return {name for name in candidates
            if sizes.get(name, 0) >= FED_MIN_BYTES and name not in inside and name not in outputs
            and readers.get(name) and all(any(i not in constants for i in node.input) for node in readers[name])}


def make_inputs(graph: Any, names: set[str]) -> None:
    """Turn the initializers ``names`` of the GraphProto ``graph`` into graph inputs of the same
    type and shape, in place."""
    from onnx import helper

    moved = [t for t in graph.initializer if t.name in names]
    kept = [t for t in graph.initializer if t.name not in names]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in moved)
