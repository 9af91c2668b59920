"""The ONNX Runtime backend: graphopt ops exported as ORT's fused ops, run in an InferenceSession.

- ``target.onnxruntime``: the ``torch.compile`` target (``options={"target": "onnxruntime"}``).
- ``export.export_graph``: optimized FX graph -> ONNX model (``OnnxModel``, over onnx-ir).
- ``translations/``: one module per op family, each a ``TRANSLATIONS`` dict of op overload ->
  ONNX translation, discovered with pkgutil (add a family by adding a file).
- ``lowering``: checks and the ORT-specific rewrite (attention over a KV cache -> GQA with past).
- ``session``: sessions per execution provider, and running them on torch tensors.
- ``tool``: the pipeline behind ``graphopt export``; ``generate``: KV-cache export and greedy
  generation on ORT.

Importing this package imports nothing from onnx or onnxruntime: the target says what is
missing in one line when they are not installed.
"""
