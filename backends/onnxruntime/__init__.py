"""The ONNX Runtime backend: graphopt ops exported as ORT's fused ops, run in an InferenceSession.

Modules here:
- ``target``: the ``torch.compile`` target (``options={"target": "onnxruntime"}``), the entry
  the registry imports.
- ``exporter``: what the target lends ``graphopt export`` (graphopt/export): an optimized graph
  lowered to an ``.onnx`` file, and a session to check it; it runs no pass.
- ``errors``: the target's errors, one line each, naming the op.

Rooms, by job:
- ``lower/``: optimized FX graph -> ONNX model (``export.export_graph``, the direct and traced
  routes, legalisation, ORT schemas, symbolic sizes, per-op partitioning, ``translations/``).
- ``onnx_passes/``: rewrites of the exported ONNX model (cleanup, attention layout, MatMul
  reshapes, rotary folded into attention, transposed weights).
- ``runtime/``: sessions per execution provider and the memory around them (in-memory
  weights, bound outputs, heap trims).
- ``compile/``: the target's strategies across a model's graphs (lazy builds on recompile,
  session reuse, which nodes run on ORT).
- ``decoder/``: generation on ORT (the step runner for ``graphopt.generate``, the in-place
  KV-cache decoder and its disk cache, the prefill/decode pair, transformers' cache steps).

Importing this package imports nothing from onnx or onnxruntime: the target says what is
missing in one line when they are not installed.
"""
