"""Every supported GGUF type re-laid out as graphopt's block format dequantizes bit for bit to
``gguf``'s own dequantized values: legacy types quantized with ``gguf``'s quantizer from random
data, K-quants (which ``gguf`` cannot quantize) as random valid blocks."""

import numpy as np
import pytest

from graphopt.ops.quant_blocks import BlockFormat
from graphopt.sources import gguf_blocks
from tests.models.gguf_helpers import T, gguf, quantized

TYPES = sorted(gguf_blocks.NAMES, key=int)


@pytest.mark.parametrize("qtype", TYPES, ids=[gguf_blocks.NAMES[t] for t in TYPES])
def test_relayout_dequantizes_to_ggufs_values_bit_for_bit(qtype):
    rng = np.random.default_rng(int(qtype))
    raw = quantized(rng.standard_normal((40, 512)).astype(np.float32), qtype, rng)
    expected = gguf.quants.dequantize(raw, T(qtype)).astype(np.float32)
    blocks = gguf_blocks.relayout(raw, qtype, 512)
    assert np.array_equal(blocks.dequantize().view(np.uint32), expected.view(np.uint32))
    # and exactly as wide as its declared format says
    assert blocks.codes.shape == (40, 512 // blocks.group_size, blocks.group_size * blocks.bits // 8)
    assert blocks.format == gguf_blocks_format(qtype)


def gguf_blocks_format(qtype) -> BlockFormat:
    from graphopt.sources.gguf_lazy import FORMATS

    return FORMATS[qtype]


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
    blocks = gguf_blocks.relayout(raw, T.Q4_K, 256, after_read=lambda: released.append(1))
    assert released == []  # nothing decoded yet
    blocks.scales
    assert released == [1]
    blocks.codes
    assert released == [1, 1]
