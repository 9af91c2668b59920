"""Optimized FX graph -> ONNX model with graphopt ops as ONNX Runtime's fused ops.

- ``export``: ``export_graph``, the entry: FX graph -> ``OnnxModel`` (over onnx-ir), by the
  direct or the traced route, with dynamic axes where the graph's sizes are symbolic.
- ``onnx_model``: ``OnnxModel``, the exported model: its op counts, INT4 weights and saving,
  and its weights read from the checkpoint only when written.
- ``direct_export``: the direct route: the exporter's translation step without torch.export's
  two re-traces, when the graph needs none.
- ``type_promotion``: torch.onnx's cast-inserting pass, reading the fake values the graph carries.
- ``lowering``: the backend's legalisation: every graphopt op has a translation, and attention
  over a KV cache -> GroupQueryAttention with past.
- ``schemas``: ONNX Runtime's contrib op schemas registered with onnx, so onnxscript emits them.
- ``signatures``: where a graph's symbolic sizes come from at run time (``SizePlan``), or one
  model per input signature (``PerSignature``).
- ``partition``: per-op fallback: decompose what has no translation, split off what cannot export.
- ``translations/``: one module per op family, each a ``TRANSLATIONS`` dict of op overload ->
  ONNX translation, discovered with pkgutil (add a family by adding a file).
"""
