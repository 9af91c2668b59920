"""llama.cpp's quantized blocks re-laid out as graphopt's block format, value for value.

Each supported ggml type becomes codes, scales and (where it has a float minimum) offsets
in the format of ``graphopt.ops.quant_blocks``, read from the file's bytes with integer and
exact float operations only: the result dequantizes to exactly ggml's values (tests check it
against ``gguf``'s own dequantizer, bit for bit). Block layouts are ggml's (``ggml-common.h``):

| type | block | stored | value | here |
|---|---|---|---|---|
| Q4_0 | 32 | d f16, 16 B of nibbles | d * (q - 8) | 4-bit, implied zero 8 |
| Q4_1 | 32 | d, m f16, nibbles | d * q + m | 4-bit, zero 0, offset m (folded: see below) |
| Q5_0 | 32 | d, 4 B high bits, nibbles | d * (q - 16) | 8-bit, q + 112 (zero 128) |
| Q5_1 | 32 | d, m, high bits, nibbles | d * q + m | 8-bit, q + 128, offset m |
| Q8_0 | 32 | d, 32 int8 | d * q | 8-bit, q + 128 |
| Q4_K | 256 = 8 x 32 | d, dmin f16, 12 B of 6-bit scales/mins, nibbles | d*sc * q - dmin*m | 4-bit, zero 0, offset (folded) |
| Q5_K | 256 = 8 x 32 | as Q4_K plus 32 B of high bits | d*sc * q - dmin*m | 8-bit, offset |
| Q6_K | 256 = 16 x 16 | 128 B low nibbles, 64 B high pairs, 16 int8 scales, d | d*sc * (q - 32) | 8-bit, block 16 |

Nibble order: ggml keeps element j of a 32-block in the low nibble of byte j and element
j + 16 in the high nibble (K-quants: per 64 elements, byte j holds j and j + 32), where
MatMulNBits wants elements 2j and 2j + 1 in one byte; the codes are re-packed, not changed.
5- and 6-bit codes widen to 8 bits exactly (MatMulNBits has no 5- or 6-bit kernel).

Folded zero points (Q4_1, Q4_K): ``s * q + o`` is also ``s * (q - 8) + (o + 8 * s)``, the
implied zero point 8 and no zero-point tensor, which ONNX Runtime's 4-bit kernel runs about
20 % faster (13 -> 16 G weights/s here). It is exact when ``o + 8 * s`` is a float32 for every
block (then ``(q - 8) * s`` is exact and adding the new offset rounds once, to the same value as
``s * q + o``), which ``relayout`` checks over the whole tensor before it picks the layout: a
tensor with one block that would round keeps its zero points. Every block of Qwen2.5-0.5B's
Q4_K tensors folds.
"""

from __future__ import annotations

import functools

import numpy as np

from graphopt.ops.quant_blocks import BlockQuantized, pack_codes, pack_zero_points

# ggml type ids (gguf.GGMLQuantizationType) of the types re-laid out here
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K",
         Q6_K: "Q6_K"}
BLOCK_BYTES = {Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
               Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}


def supported(ggml_type: int) -> bool:
    return ggml_type in BLOCK_BYTES


ROWS_PER_CHUNK = 4096  # decoded at a time: a field's temporaries stay a few MB whatever the tensor


def relayout(raw: np.ndarray, ggml_type: int, in_features: int, after_read=None,
             fold: bool | None = None) -> BlockQuantized:
    """``raw``: uint8 ``[N, bytes per row]`` of one tensor as the file stores it (a memory map:
    nothing is read until a field is). Each field is decoded when first read, a few thousand
    rows at a time into its result (so a 151k-row table's temporaries are not 151k rows);
    ``after_read()`` is called after each field (the file lets go of the pages it read).

    ``fold``: whether a Q4_1 / Q4_K tensor's zero points fold into its offsets (module
    docstring); None works it out from ``raw`` (its scales and minimums, read once). Give the
    whole tensor's answer when ``raw`` is some of its rows, so every part has one layout."""
    elements, size = BLOCK_BYTES[ggml_type]
    blocks = raw.reshape(raw.shape[0], in_features // elements, size)
    layout = _DECODERS[ggml_type]
    if ggml_type in FOLDABLE:
        if fold is None:
            fold = folds_exactly(blocks, layout, in_features)
            if after_read is not None:
                after_read()
        layout = functools.partial(layout, fold=fold)
    whole = layout(blocks[:1], in_features)  # one row: the fields' dtypes and trailing shapes
    fields = {name: functools.partial(_by_rows, layout, blocks, in_features, name, after_read)
              for name in ("codes", "scales", "zeros", "offsets")}
    return BlockQuantized(whole.bits, whole.group_size, in_features, whole.format.zeros, whole.format.offsets,
                          **fields)


def folds_exactly(blocks: np.ndarray, layout, in_features: int) -> bool:
    """Whether ``offset + 8 * scale`` is exact in float32 for every block of a Q4_1 / Q4_K
    tensor (``blocks`` ``[N, B, bytes]``), worked out a few thousand rows at a time."""
    for start in range(0, blocks.shape[0], ROWS_PER_CHUNK):
        part = layout(blocks[start:start + ROWS_PER_CHUNK], in_features, fold=False)
        folded = part.offsets.astype(np.float64) + 8 * part.scales.astype(np.float64)
        if not np.array_equal(folded.astype(np.float32).astype(np.float64), folded):
            return False
    return True


def fold_of(raw: np.ndarray, ggml_type: int, in_features: int) -> bool | None:
    """``relayout``'s ``fold`` for the whole tensor ``raw``; None for a type without one."""
    if ggml_type not in FOLDABLE:
        return None
    elements, size = BLOCK_BYTES[ggml_type]
    return folds_exactly(raw.reshape(raw.shape[0], in_features // elements, size), _DECODERS[ggml_type], in_features)


def _by_rows(layout, blocks: np.ndarray, in_features: int, name: str, after_read) -> np.ndarray:
    out = None
    for start in range(0, blocks.shape[0], ROWS_PER_CHUNK):
        part = getattr(layout(blocks[start:start + ROWS_PER_CHUNK], in_features), name)
        if out is None:
            out = np.empty((blocks.shape[0], *part.shape[1:]), part.dtype)
        out[start:start + part.shape[0]] = part
    if after_read is not None:
        after_read()
    return out


def _records(blocks: np.ndarray, **fields: tuple[str, int]) -> np.ndarray:
    """The blocks ``[N, B, bytes]`` as ``N * B`` records of ``fields`` (name: (dtype, byte
    offset)), no copy: a field is one long strided array where a slice of the byte axis has
    rows of a few bytes, which numpy walks a few bytes at a time."""
    dtype = np.dtype({"names": list(fields), "formats": [f for f, _ in fields.values()],
                      "offsets": [at for _, at in fields.values()], "itemsize": blocks.shape[-1]})
    return np.ascontiguousarray(blocks).reshape(-1).view(dtype)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """float32 ``[N, B]`` from the little-endian float16 at byte ``start`` of each block."""
    return _records(blocks, d=("<f2", start))["d"].astype(np.float32).reshape(blocks.shape[:-1])


NIBBLES = 0x0F0F_0F0F_0F0F_0F0F  # the low nibble of each byte of a uint64
EACH_BYTE = 0x0101_0101_0101_0101
# byte x -> a uint64 whose byte k is 16 where bit k of x is set: 8 high bits, in place above 8 nibbles
_SPREAD = np.array([sum(((x >> k) & 1) << (8 * k + 4) for k in range(8)) for x in range(256)], "<u8")


def _q5_codes(blocks: np.ndarray, qh_at: int, qs_at: int, base: int) -> np.ndarray:
    """uint8 ``[N, B, 32]``: ``base`` + the 5-bit codes of Q5_0 / Q5_1 blocks (nibbles at
    ``qs_at``, ggml's order; high bits a little-endian uint32 at ``qh_at``, bit j element j),
    worked out 8 codes to a uint64 (a code and base stay under 256: no byte carries)."""
    r = _records(blocks, qh=("<u4", qh_at), lo=("<u8", qs_at), hi=("<u8", qs_at + 8))
    out = np.empty((r.shape[0], 4), "<u8")  # elements 0-7, 8-15 (low nibbles), 16-23, 24-31 (high)
    lo, hi, qh = r["lo"], r["hi"], r["qh"]
    np.bitwise_and(lo, NIBBLES, out=out[:, 0])
    np.bitwise_and(hi, NIBBLES, out=out[:, 1])
    np.bitwise_and(lo >> 4, NIBBLES, out=out[:, 2])
    np.bitwise_and(hi >> 4, NIBBLES, out=out[:, 3])
    for group in range(4):
        out[:, group] |= _SPREAD[(qh >> 8 * group) & 0xFF]
    out += base * EACH_BYTE
    return out.view(np.uint8).reshape(*blocks.shape[:-1], 32)


def _split_nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 32-element nibble order (byte j: elements j, j + 16) -> one code a value."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def _zero_codes(b: np.ndarray, groups: int, bits: int):
    return lambda: pack_zero_points(np.zeros((b.shape[0], groups), np.uint8), bits)


def _folded(scales, offsets, bits: int):
    """The offsets of codes read with the implied zero point instead of zero point 0:
    ``s * q + o == s * (q - z) + (o + z * s)`` (exact where ``folds_exactly`` said so)."""
    return lambda: offsets() + (1 << (bits - 1)) * scales()


def _legacy(b: np.ndarray, k: int, bits: int, codes, offset: bool = False, zero: bool = False,
            fold: bool = False) -> BlockQuantized:
    """The 32-element types: d at byte 0, m (a float minimum) at byte 2 when ``offset``;
    ``fold``: zero point 0 folded into the offsets (module docstring)."""
    scales, offsets = (lambda: _f16(b, 0)), (lambda: _f16(b, 2))
    return BlockQuantized(bits, 32, k, zero and not fold, offset, codes=lambda: pack_codes(codes(), bits),
                          scales=scales, zeros=_zero_codes(b, b.shape[1], bits),
                          offsets=_folded(scales, offsets, bits) if fold else offsets)


def _q4_0(b, k):
    return _legacy(b, k, 4, lambda: _split_nibbles(b[..., 2:]))


def _q4_1(b, k, fold: bool = False):
    return _legacy(b, k, 4, lambda: _split_nibbles(b[..., 4:]), offset=True, zero=True, fold=fold)


def _q5_0(b, k):  # q - 16 == (q + 112) - 128
    return _legacy(b, k, 8, lambda: _q5_codes(b, 2, 6, 112))


def _q5_1(b, k):  # q == (q + 128) - 128; the minimum is the offset
    return _legacy(b, k, 8, lambda: _q5_codes(b, 4, 8, 128), offset=True)


def _q8_0(b, k):  # int8 q + 128, as uint8
    return _legacy(b, k, 8, lambda: b[..., 2:] ^ 0x80)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes of eight 6-bit scales and eight 6-bit mins (ggml's ``get_scale_min_k4``)."""
    low, mid, top = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate((low & 0x3F, (top & 0x0F) | ((low >> 2) & 0x30)), axis=-1)
    mins = np.concatenate((mid & 0x3F, (top >> 4) | ((mid >> 2) & 0x30)), axis=-1)
    return scales, mins


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes of K-quant nibbles -> [.., 8, 32] codes (per 64 elements: low nibbles, then high)."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)
    return np.stack((chunks & 0x0F, chunks >> 4), axis=-2).reshape(*qs.shape[:-1], 8, 32)


def _k_quant(b: np.ndarray, k: int, bits: int, codes, fold: bool = False) -> BlockQuantized:
    """Q4_K and Q5_K: super-blocks of 256 with d, dmin and eight 6-bit (scale, min) pairs."""
    n, supers = b.shape[:2]

    def scales():
        return (_f16(b, 0)[..., None] * _k_scales(b[..., 4:16])[0].astype(np.float32)).reshape(n, supers * 8)

    def offsets():
        return -(_f16(b, 2)[..., None] * _k_scales(b[..., 4:16])[1].astype(np.float32)).reshape(n, supers * 8)

    zero = bits == 4 and not fold
    return BlockQuantized(bits, 32, k, zero, True, codes=lambda: pack_codes(codes().reshape(n, supers * 8, 32), bits),
                          scales=scales, zeros=_zero_codes(b, supers * 8, bits),
                          offsets=_folded(scales, offsets, bits) if fold else offsets)


def _q4_k(b, k, fold: bool = False):
    return _k_quant(b, k, 4, lambda: _k_nibbles(b[..., 16:144]), fold)


def _q5_k(b, k):
    def codes():
        high = np.unpackbits(b[..., 16:48], axis=-1, bitorder="little").reshape(*b.shape[:2], 32, 8)
        high = np.moveaxis(high, -1, -2)  # bit i of byte j is the high bit of element 32 * i + j
        return (_k_nibbles(b[..., 48:176]) | (high << 4)) + 128  # the offset carries the minimum
    return _k_quant(b, k, 8, codes)


def _q6_k(b, k):
    n, supers = b.shape[:2]

    def codes():
        ql, qh = b[..., 0:128].reshape(n, supers, 2, 64), b[..., 128:192].reshape(n, supers, 2, 32)
        # per 128 elements: ql bytes 0..63 give elements 0..63 (low nibble) and 64..127 (high);
        # qh byte j gives bits 4-5 of elements j, j + 32, j + 64, j + 96 (bit pairs 0, 2, 4, 6)
        low = np.concatenate((ql & 0x0F, ql >> 4), axis=-1)
        high = np.concatenate([(qh >> shift) & 0x03 for shift in (0, 2, 4, 6)], axis=-1)
        return pack_codes((low | (high << 4)).reshape(n, supers * 16, 16) + 96, 8)  # q - 32 == (q + 96) - 128

    def scales():
        sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
        return (_f16(b, 208)[..., None] * sc).reshape(n, supers * 16)

    return BlockQuantized(8, 16, k, False, False, codes=codes, scales=scales)


FOLDABLE = (Q4_1, Q4_K)  # 4-bit with a float minimum: zero points 0 that may fold (module docstring)
_DECODERS = {Q4_0: _q4_0, Q4_1: _q4_1, Q5_0: _q5_0, Q5_1: _q5_1, Q8_0: _q8_0, Q4_K: _q4_k, Q5_K: _q5_k,
             Q6_K: _q6_k}
