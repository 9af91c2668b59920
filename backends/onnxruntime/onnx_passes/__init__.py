"""Rewrites of an exported ONNX model, after translation: ONNX passes, each an object with a name,
a summary and ``run(model) -> OnnxPassResult``, run and reported by ``runner``.

- ``runner``: the ONNX pass protocol and ``run_onnx_passes``, which times each pass and gives
  the report the records and near misses FX passes get (``onnx:<name>`` in ``report.passes``);
  ``record_run`` does the same for a rewrite of another form of the model.
- ``onnx_cleanup``: what every export gets: constants folded, dead nodes and unread optional
  outputs dropped, outputs cast back to eager's dtypes, dynamic axes named.
- ``attention_layout``: attention's reshape/transpose round trips removed from an exported decoder.
- ``matmul_reshapes``: a projection's flatten/unflatten around its MatMul removed.
- ``rotary_fold``: q/k rotary moved into GroupQueryAttention (``do_rotary``) on the in-place decoder.
- ``transposed_weights``: ``FusedMatMul(transB=1)`` on a weight's row-major buffer instead of a
  transposed copy, in the bytes a CPU session is made from (recorded on the session).
"""
