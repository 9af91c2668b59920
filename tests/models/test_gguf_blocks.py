"""Every supported GGUF type re-laid out as graphopt's block format dequantizes bit for bit to
``gguf``'s own dequantized values: legacy types quantized with ``gguf``'s quantizer from random
data, K-quants (which ``gguf`` cannot quantize) as random valid blocks."""

import dataclasses

import numpy as np
import pytest

from graphopt.ops.quant_blocks import BlockFormat
from graphopt.sources import gguf_blocks
from tests.models.gguf_helpers import T, gguf, quantized

TYPES = sorted(gguf_blocks.NAMES, key=int)


def bit_for_bit(ours: np.ndarray, theirs: np.ndarray) -> bool:
    """The same float32 bits, but for the sign of a zero: a folded zero point gives
    ``(0 - 8) * s + 8 * s == +0`` where gguf's ``s * 0 + (-0)`` is -0 for a negative scale (the
    random K-quant blocks here have some; real files' scales are positive). Adding +0 makes
    every zero +0 and changes no other value."""
    return ours.shape == theirs.shape and np.array_equal((ours + np.float32(0)).view(np.uint32),
                                                         (theirs + np.float32(0)).view(np.uint32))


@pytest.mark.parametrize("qtype", TYPES, ids=[gguf_blocks.NAMES[t] for t in TYPES])
def test_relayout_dequantizes_to_ggufs_values_bit_for_bit(qtype):
    rng = np.random.default_rng(int(qtype))
    raw = quantized(rng.standard_normal((40, 512)).astype(np.float32), qtype, rng)
    expected = gguf.quants.dequantize(raw, T(qtype)).astype(np.float32)
    blocks = gguf_blocks.relayout(raw, qtype, 512)
    assert bit_for_bit(blocks.dequantize(), expected)
    # and exactly as wide as its declared format says
    assert blocks.codes.shape == (40, 512 // blocks.group_size, blocks.group_size * blocks.bits // 8)
    fmt = gguf_blocks_format(qtype)
    assert blocks.format == (dataclasses.replace(fmt, zeros=False) if qtype in gguf_blocks.FOLDABLE else fmt)


def gguf_blocks_format(qtype) -> BlockFormat:
    from graphopt.sources.gguf_lazy import FORMATS

    return FORMATS[qtype]


@pytest.mark.parametrize("qtype", gguf_blocks.FOLDABLE, ids=[gguf_blocks.NAMES[t] for t in gguf_blocks.FOLDABLE])
def test_folded_and_unfolded_zero_points_give_the_same_values(qtype):
    """Q4_1 / Q4_K: codes with zero point 0 plus offsets, or the implied zero point 8 with the
    offsets moved by 8 scales: both dequantize to gguf's values bit for bit."""
    rng = np.random.default_rng(7)
    raw = quantized(rng.standard_normal((16, 512)).astype(np.float32), qtype, rng)
    expected = gguf.quants.dequantize(raw, T(qtype)).astype(np.float32)
    assert gguf_blocks.fold_of(raw, qtype, 512)
    folded, plain = (gguf_blocks.relayout(raw, qtype, 512, fold=f) for f in (True, False))
    assert folded.zeros is None and not folded.format.zeros
    assert plain.zeros is not None and plain.format.zeros
    assert not np.array_equal(folded.offsets, plain.offsets)  # moved, not the same arrays
    for blocks in (folded, plain):
        assert bit_for_bit(blocks.dequantize(), expected)


def test_a_block_whose_folded_offset_would_round_keeps_the_zero_points():
    """One Q4_1 block with m + 8 d not a float32 (m = 1024, d = 2**-14 + 2**-24 span 35 bits):
    the whole tensor keeps zero point 0 and its own offsets, still exact."""
    rng = np.random.default_rng(8)
    raw = quantized(rng.standard_normal((4, 64)).astype(np.float32), T.Q4_1, rng).copy()
    blocks = raw.reshape(4, 2, 20)
    blocks[2, 1, 0:2] = np.array([2.0 ** -14 + 2.0 ** -24], np.float16).view(np.uint8)
    blocks[2, 1, 2:4] = np.array([1024.0], np.float16).view(np.uint8)
    expected = gguf.quants.dequantize(raw, T.Q4_1).astype(np.float32)
    assert not gguf_blocks.fold_of(raw, T.Q4_1, 64)
    kept = gguf_blocks.relayout(raw, T.Q4_1, 64)
    assert kept.format.zeros and kept.zeros is not None
    assert bit_for_bit(kept.dequantize(), expected)


@pytest.mark.parametrize("qtype", [T.Q5_0, T.Q4_K, T.Q6_K], ids=["Q5_0", "Q4_K", "Q6_K"])
def test_rows_decoded_in_chunks_give_the_whole(monkeypatch, qtype):
    rng = np.random.default_rng(3)
    raw = quantized(rng.standard_normal((23, 256)).astype(np.float32), qtype, rng)
    whole = gguf_blocks.relayout(raw, qtype, 256)
    monkeypatch.setattr(gguf_blocks, "ROWS_PER_CHUNK", 5)
    chunked = gguf_blocks.relayout(raw, qtype, 256)
    for name in ("codes", "scales", "zeros", "offsets"):
        a, b = getattr(whole, name), getattr(chunked, name)
        assert (a is None and b is None) or np.array_equal(a, b), name


def test_each_field_reads_the_file_when_asked_and_lets_it_go():
    rng = np.random.default_rng(4)
    raw = quantized(rng.standard_normal((8, 256)).astype(np.float32), T.Q4_K, rng)
    released = []
    blocks = gguf_blocks.relayout(raw, T.Q4_K, 256, after_read=lambda: released.append(1), fold=True)
    assert released == []  # nothing decoded yet
    blocks.scales
    assert released == [1]
    blocks.codes
    assert released == [1, 1]
    # Left to relayout, whether zero points fold is worked out from the scales and minimums
    # up front, and the pages that read are let go too.
    gguf_blocks.relayout(raw, T.Q4_K, 256, after_read=lambda: released.append(2))
    assert released == [1, 1, 2]
