"""Weight quantization: the numerics behind the INT4 / INT8 passes, on plain tensors.

- ``groupwise``: group-wise INT4 and INT8 quantization (round-to-nearest, a per-group
  scale search), ``Int4Weight``, the format ``graphopt.int4_linear`` reads;
- ``gptq``: GPTQ-style error feedback on calibration activations, and the output error;
- ``rounding``: what both share: codes to the nearest integer, a scale as stored, one thread;
- ``plan``: before the rewrite: calibration inputs, per-layer Hessians, which layers get 8 bits;
- ``report``: the numbers a quantized run is judged by: weight bytes, per-layer and logits error, top-1.

The pass that uses them is passes/quantize_int4.py (with its plan, embedding and MoE helpers).
"""
