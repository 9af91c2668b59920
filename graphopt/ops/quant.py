"""INT4 weight-only linear: ``graphopt.int4_linear`` and its packing format.

The format is ONNX Runtime's ``MatMulNBits`` (com.microsoft) layout, so the ORT lowering
passes the tensors through untouched and the Triton kernel reads the same bytes:

- ``packed``: uint8 ``[N, K_pad / 2]``: the [N, K] weight (nn.Linear layout) quantized to
  4-bit codes q in 0..15, two codes a byte along K: element 2j in the low nibble,
  2j + 1 in the high nibble. ``K_pad = G * group_size`` is K rounded up to whole
  groups; the padding codes dequantize to 0. Viewed as ``[N, G, group_size / 2]`` it is
  MatMulNBits' ``B`` input byte for byte.
- ``scales``: ``[N, G]`` float16 / bfloat16 / float32, one per group of ``group_size``
  consecutive K elements of a row. May be negative (a sign flip lets the symmetric
  grid put its lone -8 level on the group's largest-magnitude value).
- ``zeros``: None (symmetric: every zero point is 8) or uint8 ``[N, ceil(G / 2)]``: the
  4-bit zero points packed like ``packed`` (group 2j low nibble).

Dequantized weight: ``w[n, k] = (q[n, k] - z[n, k // group_size]) * scales[n, k // group_size]``.

``graphopt.int8_linear`` is the same layout at 8 bits (one code a byte, symmetric, zero
point 128: MatMulNBits with bits=8), for the layers 4 bits cost too much (an LM head).

``graphopt.quantized_embedding`` looks rows up in a [vocab, hidden] table stored in either
format (N = vocab, K = hidden): a table tied to an LM head can be the head's own tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from graphopt.ops._library import register

GROUP_SIZES = (32, 64, 128)
SYMMETRIC_ZERO = 8  # the implied zero point when ``zeros`` is None (2 ** (bits - 1))
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def pack_int4(codes: Tensor) -> Tensor:
    """uint8 codes 0..15 ``[R, C]`` -> uint8 ``[R, ceil(C / 2)]``, element 2j in the low nibble.

    An odd C is padded with a 0 code in the last high nibble.
    """
    if codes.dim() != 2:
        raise ValueError(f"pack_int4 takes a 2-D tensor of codes, got shape {tuple(codes.shape)}")
    codes = codes.to(torch.uint8)
    if codes.shape[1] % 2:
        codes = F.pad(codes, (0, 1))
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_int4(packed: Tensor, columns: int | None = None) -> Tensor:
    """Inverse of :func:`pack_int4`: uint8 ``[R, C2]`` -> uint8 codes ``[R, columns or 2 * C2]``."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"packed int4 data must be 2-D uint8, got {packed.dtype} {tuple(packed.shape)}")
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
    return codes if columns is None else codes[:, :columns]


def check_format(packed: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int,
                 in_features: int | None = None) -> tuple[int, int, int]:
    """Validate the tensors of one INT4 weight; return (N, G, K_pad). One-line errors."""
    if group_size < 2 or group_size % 2:
        raise ValueError(f"int4 group_size must be even and >= 2, got {group_size}")
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"int4 packed weight must be 2-D uint8 [N, K/2], got {packed.dtype} {tuple(packed.shape)}")
    if scales.dim() != 2 or scales.dtype not in SCALE_DTYPES:
        raise ValueError(f"int4 scales must be 2-D float16/bfloat16/float32 [N, G], got {scales.dtype} "
                         f"{tuple(scales.shape)}")
    n, groups = scales.shape
    k_pad = groups * group_size
    if tuple(packed.shape) != (n, k_pad // 2):
        raise ValueError(f"int4 packed weight is {tuple(packed.shape)}; scales {tuple(scales.shape)} with "
                         f"group_size {group_size} need ({n}, {k_pad // 2})")
    if zeros is not None and (zeros.dtype != torch.uint8 or tuple(zeros.shape) != (n, (groups + 1) // 2)):
        raise ValueError(f"int4 zero points must be uint8 ({n}, {(groups + 1) // 2}), got {zeros.dtype} "
                         f"{tuple(zeros.shape)}")
    if in_features is not None and not k_pad - group_size < in_features <= k_pad:
        raise ValueError(f"input has {in_features} features but the int4 weight holds {groups} groups of "
                         f"{group_size} (K between {k_pad - group_size + 1} and {k_pad})")
    return n, groups, k_pad


def dequantize_int4(packed: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int,
                    in_features: int | None = None) -> Tensor:
    """The float32 ``[N, K]`` weight the codes stand for (``K = in_features`` or ``K_pad``).

    float32 whatever the scale dtype: ``(q - z) * s`` of a 4-bit integer and a 16-bit
    float is exact there, so casting the result to float16 rounds exactly once, as a
    kernel computing in the activation dtype does.
    """
    n, groups, k_pad = check_format(packed, scales, zeros, group_size, in_features)
    codes = unpack_int4(packed).view(n, groups, group_size).float()
    zero = (unpack_int4(zeros, groups).float() if zeros is not None
            else torch.full((n, groups), float(SYMMETRIC_ZERO), device=packed.device))
    weight = ((codes - zero.unsqueeze(-1)) * scales.float().unsqueeze(-1)).reshape(n, k_pad)
    return weight if in_features is None else weight[:, :in_features]


@torch.library.custom_op("graphopt::int4_linear", mutates_args=())
def int4_linear(x: Tensor, packed: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int,
                bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, dequantize_int4(packed, scales, zeros, group_size), bias)``.

    ``x`` is [..., K]; the output [..., N] has x's dtype. The reference dequantizes the
    whole weight; kernels (Triton, MatMulNBits) dequantize inside the GEMM's K loop.
    """
    weight = dequantize_int4(packed, scales, zeros, group_size, x.shape[-1]).to(x.dtype)
    return F.linear(x, weight, bias)


@int4_linear.register_fake
def _(x, packed, scales, zeros, group_size, bias=None):
    n, _, _ = check_format(packed, scales, zeros, group_size, x.shape[-1])
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"int4_linear bias must be ({n},), got {tuple(bias.shape)}")
    return x.new_empty((*x.shape[:-1], n))


register("int4_linear")


# --- 8 bits: where 4 costs a layer too much (an LM head, a sensitive projection) ----------

INT8_ZERO = 128  # the implied zero point of the symmetric 8-bit grid (2 ** (bits - 1))


def dequantize_int8(qweight: Tensor, scales: Tensor, group_size: int, in_features: int | None = None) -> Tensor:
    """float32 ``[N, K]`` of 8-bit codes ``qweight`` uint8 ``[N, K_pad]`` (one code a byte,
    MatMulNBits' bits=8 ``B`` viewed as [N, G, group_size]) and ``scales`` ``[N, G]``:
    ``w[n, k] = (q[n, k] - 128) * scales[n, k // group_size]``."""
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError(f"int8 weight must be 2-D uint8 [N, K], got {qweight.dtype} {tuple(qweight.shape)}")
    if scales.dim() != 2 or scales.dtype not in SCALE_DTYPES:
        raise ValueError(f"int8 scales must be 2-D float16/bfloat16/float32 [N, G], got {scales.dtype} "
                         f"{tuple(scales.shape)}")
    n, groups = scales.shape
    if tuple(qweight.shape) != (n, groups * group_size):
        raise ValueError(f"int8 weight is {tuple(qweight.shape)}; scales {tuple(scales.shape)} with group_size "
                         f"{group_size} need ({n}, {groups * group_size})")
    if in_features is not None and not (groups - 1) * group_size < in_features <= groups * group_size:
        raise ValueError(f"input has {in_features} features but the int8 weight holds {groups} groups of {group_size}")
    weight = ((qweight.view(n, groups, group_size).float() - INT8_ZERO) * scales.float().unsqueeze(-1)).reshape(n, -1)
    return weight if in_features is None else weight[:, :in_features]


@torch.library.custom_op("graphopt::int8_linear", mutates_args=())
def int8_linear(x: Tensor, qweight: Tensor, scales: Tensor, group_size: int, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, dequantize_int8(qweight, scales, group_size), bias)``: symmetric 8-bit
    group-wise weights, lowered to MatMulNBits with bits=8 on ONNX Runtime."""
    weight = dequantize_int8(qweight, scales, group_size, x.shape[-1]).to(x.dtype)
    return F.linear(x, weight, bias)


@int8_linear.register_fake
def _(x, qweight, scales, group_size, bias=None):
    n = scales.shape[0]
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.shape[0] != n:
        raise ValueError(f"int8 weight must be uint8 [{n}, K], got {qweight.dtype} {tuple(qweight.shape)}")
    return x.new_empty((*x.shape[:-1], n))


register("int8_linear")


# --- embeddings: the table quantized row-wise in the same format ------------------------

EMBEDDING_BITS = (4, 8)


def check_embedding(codes: Tensor, scales: Tensor, bits: int, group_size: int, hidden: int) -> tuple[int, int]:
    """Validate a quantized embedding table; return (vocab, groups). One-line errors."""
    if bits not in EMBEDDING_BITS:
        raise ValueError(f"quantized_embedding bits must be 4 or 8, got {bits}")
    if codes.dtype != torch.uint8 or codes.dim() != 2:
        raise ValueError(f"quantized_embedding codes must be 2-D uint8 [vocab, hidden * bits / 8], got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    if scales.dim() != 2 or scales.dtype not in SCALE_DTYPES:
        raise ValueError(f"quantized_embedding scales must be 2-D float16/bfloat16/float32 [vocab, G], got "
                         f"{scales.dtype} {tuple(scales.shape)}")
    vocab, groups = scales.shape
    if tuple(codes.shape) != (vocab, groups * group_size * bits // 8):
        raise ValueError(f"quantized_embedding codes are {tuple(codes.shape)}; scales {tuple(scales.shape)} with "
                         f"group_size {group_size} at {bits} bits need ({vocab}, {groups * group_size * bits // 8})")
    if not (groups - 1) * group_size < hidden <= groups * group_size:
        raise ValueError(f"hidden size {hidden} does not fit {groups} groups of {group_size}")
    return vocab, groups


@torch.library.custom_op("graphopt::quantized_embedding", mutates_args=())
def quantized_embedding(codes: Tensor, scales: Tensor, ids: Tensor, bits: int, group_size: int, hidden: int,
                        dtype: torch.dtype) -> Tensor:
    """``F.embedding(ids, table)`` of a table [vocab, hidden] stored as symmetric group-wise
    codes along the hidden axis: ``codes`` and ``scales`` are exactly ``int4_linear``'s
    ``packed`` / ``scales`` (bits 4, zero point 8) or ``int8_linear``'s (bits 8, zero point
    128) with N = vocab and K = hidden, so a table tied to an LM head can be one set of
    tensors read by both. Only the rows ``ids`` picks are dequantized; the result is
    [*ids.shape, hidden] in ``dtype`` (the table's dtype before quantization)."""
    _, groups = check_embedding(codes, scales, bits, group_size, hidden)
    rows = ids.reshape(-1)
    # int32 before unpacking: this reference is also what the ONNX export decomposes the op
    # into, and the exporter types a uint8 shift as int8.
    picked = codes.index_select(0, rows).to(torch.int32)
    if bits == 4:
        picked = torch.stack((picked & 0xF, picked >> 4), dim=-1)
    q = picked.reshape(-1, groups, group_size).float() - (1 << (bits - 1))
    table = (q * scales.index_select(0, rows).float().unsqueeze(-1)).reshape(-1, groups * group_size)
    return table[:, :hidden].to(dtype).reshape(*ids.shape, hidden)


@quantized_embedding.register_fake
def _(codes, scales, ids, bits, group_size, hidden, dtype):
    check_embedding(codes, scales, bits, group_size, hidden)
    return scales.new_empty((*ids.shape, hidden), dtype=dtype)


register("quantized_embedding")
