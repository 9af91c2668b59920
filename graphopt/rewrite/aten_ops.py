"""The ATen op sets passes match on, named once.

A pass names the set it needs from here and defines none of its own
(``tests/core/test_rewrite_vocabulary.py`` fails when one does): a new ATen spelling of
an existing idea (another view op, another softmax overload) is then one edit here that
every pass sees, not a hunt through the passes.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

# --- Elementwise arithmetic, in both the Tensor and the Scalar overloads aot can leave.
ADD_OPS = (aten.add.Tensor, aten.add.Scalar)
SUB_OPS = (aten.sub.Tensor, aten.sub.Scalar)
MUL_OPS = (aten.mul.Tensor, aten.mul.Scalar)
DIV_OPS = (aten.div.Tensor, aten.div.Scalar)

# x op c == x for this constant c: what canonicalize drops (x * 1, x / 1, x + 0, x - 0).
IDENTITY_OPERAND = {
    **{op: 1.0 for op in MUL_OPS}, **{op: 1.0 for op in DIV_OPS},
    **{op: 0.0 for op in ADD_OPS}, **{op: 0.0 for op in SUB_OPS},
}

# --- Shape and layout.
# Ops that reshape without moving data (what aot puts around a GEMM's 2-D view).
VIEW_OPS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
# Ops a value may flow through unchanged in content on its way to attention (views,
# GQA's expand, copies): a KV-cache value is still the cache behind them.
TRANSPARENT_OPS = (
    aten.unsqueeze.default, aten.expand.default, aten.clone.default, *VIEW_OPS, aten.slice.Tensor,
    aten.alias.default, aten.contiguous.default, aten._to_copy.default, aten.transpose.int,
    aten.permute.default,
)
# Ops whose symbolic arguments are sizes (of an axis, or a multiple of it when flattened).
SIZE_OPS = (
    *VIEW_OPS, aten.expand.default, aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default,
    aten.new_full.default, aten.zeros.default, aten.ones.default, aten.empty.memory_format, aten.full.default,
    aten.arange.default,
)
# Ops that pick rows of a value without mixing them: the last position's logits
# (``logits[:, -1]``, a gather of each row's last token) are still the LM head's output.
ROW_PICK_OPS = (aten.select.int, aten.slice.Tensor, aten.gather.default, aten.index.Tensor,
                aten.index_select.default, aten.squeeze.dim, aten.unsqueeze.default)
# Ops that cut a tensor into pieces read by getitem (chunk lowers to split under aot).
SPLIT_OPS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)
# Runtime checks on symbolic sizes that a rewrite which changes those sizes drops.
SIZE_ASSERT_OPS = (aten._assert_scalar.default, aten.sym_constrain_range.default,
                   aten.sym_constrain_range_for_size.default)
# Runtime checks on data-dependent values (a nonzero's count in an expert loop).
RUNTIME_ASSERT_OPS = (aten._assert_async.default, aten._assert_async.msg, aten._assert_scalar.default)

# --- Linear algebra.
GEMM_OPS = (aten.mm.default, aten.addmm.default, aten.linear.default)  # a linear layer's GEMM
BATCHED_MATMUL_OPS = (aten.bmm.default, aten.matmul.default)  # attention's q @ k^T and p @ v

# --- Activations and normalisation pieces.
SOFTMAX_OPS = (aten._softmax.default, aten.softmax.int)
GATE_ACTIVATION_OPS = (aten.silu.default, aten.gelu.default)  # the gate of SwiGLU / GeGLU
# 1 / t: aot writes ``1 / t`` this way (RMSNorm's ``1 / sqrt(v)``).
RECIPROCAL_OPS = (aten.reciprocal.default,)

# --- Attention.
# Every ATen spelling of scaled_dot_product_attention a captured graph can hold (the plain
# op, and the backend-specific ops it decomposes to).
SDPA_OPS = (
    aten.scaled_dot_product_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
)
# Ops between the explicit form's q @ k^T and its softmax: scale, mask, casts, views.
SCORE_OPS = (
    aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor, aten._to_copy.default, *VIEW_OPS,
    aten.masked_fill.Scalar, aten.where.self, aten.clone.default,
)

# Ops that do the heavy work of a layer (GEMMs, convolutions, attention): the points a
# weight-load schedule counts its lookahead in.
HEAVY_COMPUTE_OPS = (*GEMM_OPS, aten.bmm.default, aten.convolution.default, *SDPA_OPS)

# --- Dtype casts.
CAST_OPS = (aten._to_copy.default, torch.ops.prims.convert_element_type.default)
