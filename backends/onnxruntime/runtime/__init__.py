"""ONNX Runtime sessions, and the memory around them.

- ``session``: sessions per execution provider, and running them on torch tensors without copies.
- ``graph_runner``: a compiled graph's callable on its session (inputs, sizes, outputs in the graph's layout).
- ``weights_in_memory``: an in-memory model's weights handed to ORT as OrtValues, not serialized.
- ``bound_outputs``: a dynamic session's outputs written into torch tensors allocated before the run.
- ``heap_trim``: the C heap's free memory given back to the OS after a run that shrank ORT's arena.
"""
