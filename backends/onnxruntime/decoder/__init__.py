"""Generation on ONNX Runtime.

- ``decoder``: ``OrtRunner``, the onnxruntime target's step runner for ``graphopt.generate``.
- ``inplace_cache``: one decoder for prefill and decode whose GroupQueryAttentions update a
  shared KV buffer in place.
- ``decoder_cache``: exported in-place decoders kept on disk, so the next process skips the export.
- ``generate``: the prefill and decode-step model pair (``graphopt export --kv-cache``), and
  greedy generation on it.
- ``hf_steps``: transformers causal LMs behind the flat cache interface of ``generate``.
"""
