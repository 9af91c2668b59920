"""Block-quantized weights as a checkpoint ships them: ``graphopt.quantized_linear`` and
``graphopt.quantized_gather`` (an embedding lookup), and their tensor format.

A checkpoint that is already quantized (a llama.cpp GGUF: Q4_0, Q4_K, Q6_K, ...) runs on its
own weights: its codes and scales are re-laid out into this format, never re-rounded, so the
runtime multiplies by exactly the file's values. The format is ONNX Runtime's
``MatMulNBits`` layout with one addition, a per-block offset:

- ``codes``: uint8 ``[N, G, group_size * bits / 8]``, ``bits`` 4 or 8, the weight's K axis
  cut into G blocks of ``group_size``. 4-bit codes are two a byte along K, element 2j in
  the low nibble (MatMulNBits' ``B`` byte for byte).
- ``scales``: float32 ``[N, G]``.
- ``zeros``: None (the implied zero point ``2 ** (bits - 1)``) or uint8 zero points packed
  like MatMulNBits' ``zero_points`` (4-bit: two a byte, ``[N, ceil(G / 2)]``; 8-bit ``[N, G]``).
- ``offsets``: None or float32 ``[N, G]``, added to every weight of its block.

``w[n, g * group_size + j] = (q - z[n, g]) * scales[n, g] + offsets[n, g]``, in float32.

Why offsets: the types with a float minimum (Q4_1, Q5_1, Q4_K, Q5_K: ``w = d * q + m``) fit
MatMulNBits only with float zero points, which ONNX Runtime's CPU kernel runs on a path about
200x slower than uint8 ones. As codes with zero point 0 plus an offset, ``x @ w.T`` is
``MatMulNBits(x, codes, scales, 0) + blocksum(x) @ offsets.T``: the fast kernel, and a
GEMM G = K / group_size wide.

Exactness: a scale is a float16 times a small integer (Q4_K's 6-bit sub-block scales, Q6_K's
int8 ones), and an offset likewise, so both are exact in float32; ``(q - z) * s`` of a code and
such a scale is exact too, and adding the offset rounds once, as ggml's own ``d * q - m`` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from graphopt.ops._library import register


@dataclass
class BlockFormat:
    """What a block-quantized weight's tensors look like; equal formats concatenate along N."""

    bits: int  # 4 or 8
    group_size: int  # 16 or 32 here; MatMulNBits takes any power of two >= 16
    zeros: bool  # explicit zero points (else the implied 2 ** (bits - 1))
    offsets: bool  # a float offset per block

    def widened(self, other: "BlockFormat") -> "BlockFormat":
        """The smallest format both can be written in exactly: more bits, the smaller block,
        zero points and offsets where either has them."""
        return BlockFormat(max(self.bits, other.bits), min(self.group_size, other.group_size),
                           self.zeros or other.zeros, self.offsets or other.offsets)

    def bytes_per_weight(self) -> float:
        """Bytes ONNX Runtime reads per weight in this format (float32 scales and offsets)."""
        per_block = 4 + (4 if self.offsets else 0) + (self.bits / 8 if self.zeros else 0)
        return self.bits / 8 + per_block / self.group_size


class BlockQuantized:
    """One weight's tensors in the format of the module docstring (numpy arrays).

    Each field (``codes``, ``scales``, ``zeros``, ``offsets``) is either given or computed when
    first read (``fields`` maps a name to a function), so a runtime that writes one tensor at
    a time converts only that tensor: the scales of a table without its codes, say."""

    def __init__(self, bits: int, group_size: int, in_features: int, has_zeros: bool, has_offsets: bool,
                 **fields) -> None:
        self.bits, self.group_size, self.in_features = bits, group_size, in_features
        self.format = BlockFormat(bits, group_size, has_zeros, has_offsets)
        self._fields = fields
        self._values: dict[str, np.ndarray | None] = {}

    def _get(self, name: str) -> np.ndarray | None:
        if name not in self._values:
            if name == "zeros" and not self.format.zeros or name == "offsets" and not self.format.offsets:
                self._values[name] = None
            else:
                field = self._fields[name]
                self._values[name] = field() if callable(field) else field
        return self._values[name]

    codes = property(lambda self: self._get("codes"))
    scales = property(lambda self: self._get("scales"))
    zeros = property(lambda self: self._get("zeros"))
    offsets = property(lambda self: self._get("offsets"))

    def unpacked_codes(self) -> np.ndarray:
        """uint8 ``[N, G, group_size]``: one code a value."""
        return unpack_codes(self.codes, self.bits)

    def zero_points(self) -> np.ndarray:
        """int32 ``[N, G]``: each block's zero point."""
        scales = self.scales
        if self.zeros is None:
            return np.full(scales.shape, 1 << (self.bits - 1), np.int32)
        if self.bits == 8:
            return self.zeros.astype(np.int32)
        both = np.stack((self.zeros & 0x0F, self.zeros >> 4), axis=-1).reshape(scales.shape[0], -1)
        return both[:, :scales.shape[1]].astype(np.int32)

    def dequantize(self) -> np.ndarray:
        """float32 ``[N, K]``: the formula of the module docstring."""
        q = self.unpacked_codes().astype(np.float32)
        w = (q - self.zero_points().astype(np.float32)[..., None]) * self.scales[..., None]
        if self.offsets is not None:
            w = w + self.offsets[..., None]
        return w.reshape(w.shape[0], -1)[:, :self.in_features]

    def take_rows(self, rows: slice | None) -> "BlockQuantized":
        """Rows ``rows`` of the weight (N is rows), each field sliced when read."""
        if rows is None:
            return self
        pick = lambda name: lambda: (None if getattr(self, name) is None  # noqa: E731
                                     else np.ascontiguousarray(getattr(self, name)[rows]))
        return BlockQuantized(self.bits, self.group_size, self.in_features, self.format.zeros, self.format.offsets,
                              **{name: pick(name) for name in ("codes", "scales", "zeros", "offsets")})

    def widen(self, target: BlockFormat) -> "BlockQuantized":
        """The same values in ``target`` (``format.widened(...)`` of this one), exactly; each
        field is converted when read."""
        if self.format == target:
            return self
        if target.bits < self.bits or self.group_size % target.group_size or (self.format.zeros and not target.zeros) \
                or (self.format.offsets and not target.offsets):
            raise ValueError(f"cannot write {self.format} exactly as {target}")
        split = self.group_size // target.group_size
        # Codes and zero points move up together (4 -> 8 bits: both + 120), so q - z is unchanged.
        delta = (1 << (target.bits - 1)) - (1 << (self.bits - 1))

        def codes() -> np.ndarray:
            q = self.unpacked_codes().astype(np.int32) + delta
            return pack_codes(q.reshape(q.shape[0], -1, target.group_size).astype(np.uint8), target.bits)

        def zeros() -> np.ndarray:
            return pack_zero_points(np.repeat(self.zero_points() + delta, split, axis=1).astype(np.uint8), target.bits)

        def offsets() -> np.ndarray:
            if self.offsets is None:
                return np.zeros((self.scales.shape[0], self.scales.shape[1] * split), np.float32)
            return np.repeat(self.offsets, split, axis=1)

        return BlockQuantized(target.bits, target.group_size, self.in_features, target.zeros, target.offsets,
                              codes=codes, scales=lambda: np.repeat(self.scales, split, axis=1), zeros=zeros,
                              offsets=offsets)


def unpack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """The packed ``codes`` tensor -> uint8 ``[N, G, group]``, one code a value."""
    if bits == 8:
        return codes
    return np.stack((codes & 0x0F, codes >> 4), axis=-1).reshape(*codes.shape[:2], -1)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes ``[N, G, group]`` (one a value) -> the packed ``codes`` tensor."""
    if bits == 8:
        return np.ascontiguousarray(codes, dtype=np.uint8)
    return np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4), dtype=np.uint8)


def pack_zero_points(zeros: np.ndarray, bits: int) -> np.ndarray:
    """uint8 zero points ``[N, G]`` -> MatMulNBits' packed ``zero_points``."""
    if bits == 8:
        return np.ascontiguousarray(zeros, dtype=np.uint8)
    n, groups = zeros.shape
    if groups % 2:
        zeros = np.concatenate([zeros, np.zeros((n, 1), np.uint8)], axis=1)
    return np.ascontiguousarray(zeros[:, 0::2] | (zeros[:, 1::2] << 4), dtype=np.uint8)


def concatenate(parts: list[BlockQuantized]) -> BlockQuantized:
    """Weights stacked along N (a merged QKV or gate/up projection), widened to one format;
    each field is concatenated when read."""
    if len({p.in_features for p in parts}) != 1:
        raise ValueError("block-quantized weights of different widths do not concatenate along N")
    target = parts[0].format
    for part in parts[1:]:
        target = target.widened(part.format)
    widened = [p.widen(target) for p in parts]
    join = lambda name: lambda: np.concatenate([getattr(p, name) for p in widened], axis=0)  # noqa: E731
    return BlockQuantized(target.bits, target.group_size, parts[0].in_features, target.zeros, target.offsets,
                          **{name: join(name) for name in ("codes", "scales", "zeros", "offsets")})


# --- the ops: references in plain torch (also what a target without a kernel decomposes to) ---


def _dequantize(codes: Tensor, scales: Tensor, zeros: Tensor | None, offsets: Tensor | None, bits: int,
                group_size: int) -> Tensor:
    """float32 ``[N, G * group_size]`` of the format's tensors (rows of a table, or a weight)."""
    n, groups = scales.shape
    q = codes.to(torch.int32)  # int32 before unpacking: the ONNX export types a uint8 shift as int8
    if bits == 4:
        q = torch.stack((q & 0xF, q >> 4), dim=-1)
    q = q.reshape(n, groups, group_size).float()
    if zeros is None:
        z = torch.full((n, groups, 1), float(1 << (bits - 1)), device=codes.device)
    else:
        z = zeros.to(torch.int32)
        if bits == 4:
            z = torch.stack((z & 0xF, z >> 4), dim=-1).reshape(n, -1)[:, :groups]
        z = z.reshape(n, groups, 1).float()
    w = (q - z) * scales.float().unsqueeze(-1)
    if offsets is not None:
        w = w + offsets.float().unsqueeze(-1)
    return w.reshape(n, groups * group_size)


def check(codes: Tensor, scales: Tensor, zeros: Tensor | None, offsets: Tensor | None, bits: int,
          group_size: int, in_features: int) -> tuple[int, int]:
    """Validate one weight's tensors; return (N, G). One-line errors."""
    if bits not in (4, 8):
        raise ValueError(f"block-quantized weights have 4- or 8-bit codes, got {bits}")
    if scales.dim() != 2:
        raise ValueError(f"scales must be [N, G], got {tuple(scales.shape)}")
    n, groups = scales.shape
    if tuple(codes.shape) != (n, groups, group_size * bits // 8) or codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8 {(n, groups, group_size * bits // 8)}, got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    if zeros is not None and tuple(zeros.shape) != (n, -(-groups * bits // 8)):
        raise ValueError(f"zero points must be uint8 {(n, -(-groups * bits // 8))}, got {tuple(zeros.shape)}")
    if offsets is not None and tuple(offsets.shape) != (n, groups):
        raise ValueError(f"offsets must be [N, G] = {(n, groups)}, got {tuple(offsets.shape)}")
    if groups * group_size != in_features:
        raise ValueError(f"{groups} blocks of {group_size} do not make {in_features} input features")
    return n, groups


@torch.library.custom_op("graphopt::quantized_linear", mutates_args=())
def quantized_linear(x: Tensor, codes: Tensor, scales: Tensor, zeros: Tensor | None, offsets: Tensor | None,
                     bits: int, group_size: int, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, w, bias)`` of a block-quantized weight (module docstring); x [..., K] -> [..., N]."""
    weight = _dequantize(codes, scales, zeros, offsets, bits, group_size).to(x.dtype)
    return F.linear(x, weight, bias)


@quantized_linear.register_fake
def _(x, codes, scales, zeros, offsets, bits, group_size, bias=None):
    n, _ = check(codes, scales, zeros, offsets, bits, group_size, x.shape[-1])
    return x.new_empty((*x.shape[:-1], n))


register("quantized_linear")


@torch.library.custom_op("graphopt::quantized_gather", mutates_args=())
def quantized_gather(codes: Tensor, scales: Tensor, zeros: Tensor | None, offsets: Tensor | None, ids: Tensor,
                     bits: int, group_size: int, dtype: torch.dtype) -> Tensor:
    """``F.embedding(ids, table)`` of a block-quantized table [vocab, hidden] (N = vocab, K =
    hidden): only the rows ``ids`` picks are dequantized. Result [*ids.shape, hidden] in ``dtype``."""
    rows = ids.reshape(-1)
    pick = lambda t: t.index_select(0, rows) if t is not None else None  # noqa: E731
    table = _dequantize(pick(codes), pick(scales), pick(zeros), pick(offsets), bits, group_size)
    return table.to(dtype).reshape(*ids.shape, table.shape[-1])


@quantized_gather.register_fake
def _(codes, scales, zeros, offsets, ids, bits, group_size, dtype):
    _, groups = check(codes, scales, zeros, offsets, bits, group_size, scales.shape[1] * group_size)
    return scales.new_empty((*ids.shape, groups * group_size), dtype=dtype)


register("quantized_gather")
