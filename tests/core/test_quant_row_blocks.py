"""graphopt.quant.groupwise quantizes a weight a block of rows at a time, bit for bit as if whole:
round-to-nearest and the scale search work per row, so the chunked quantizers and
``quantize_blocks`` (a checkpoint's weight read in row blocks) store exactly the codes, scales
and zero points the whole weight gives, whatever the block."""

import pytest
import torch

from graphopt.ops.quant import INT8_ZERO, pack_int4
from graphopt.quant import groupwise
from graphopt.quant.groupwise import Int4Weight, quantize_blocks, quantize_int4, quantize_int8
from graphopt.quant.rounding import round_scale, round_ties_even


def weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    w[0, :5] = 0  # an all-zero start of a group, and a tie of magnitudes (the first one is the extreme)
    w[-1, :2] = torch.tensor([0.3, -0.3])
    return w


def int8_whole(w: torch.Tensor, group: int, dtype: torch.dtype) -> Int4Weight:
    """8-bit round-to-nearest on the whole weight at once (what quantize_int8 computed before
    it went chunk by chunk)."""
    n, k = w.shape
    groups = -(-k // group)
    v = torch.nn.functional.pad(w.float(), (0, groups * group - k)).view(n, groups, group)
    extreme = v.gather(-1, v.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
    scales = round_scale(extreme / -INT8_ZERO, dtype)
    codes = (round_ties_even(v / scales.unsqueeze(-1)) + INT8_ZERO).clamp(0, 255).to(torch.uint8)
    return Int4Weight(codes.reshape(n, -1), scales.to(dtype), None, group, k, bits=8)


def int4_whole(w: torch.Tensor, group: int, symmetric: bool, dtype: torch.dtype, search: str) -> Int4Weight:
    """4 bits on the whole weight as one chunk."""
    groups = -(-w.shape[1] // group)
    codes, scales, zeros = groupwise._quantize_rows(w, group, groups, symmetric, dtype, search)
    return Int4Weight(pack_int4(codes.reshape(w.shape[0], -1)), scales, None if symmetric else pack_int4(zeros),
                      group, w.shape[1])


def assert_same(a: Int4Weight, b: Int4Weight) -> None:
    assert (a.bits, a.group_size, a.in_features) == (b.bits, b.group_size, b.in_features)
    for x, y in ((a.packed, b.packed), (a.scales, b.scales), (a.zeros, b.zeros)):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def blocks(w: torch.Tensor, rows: int):
    return ((start, w[start:start + rows]) for start in range(0, w.shape[0], rows))


@pytest.mark.parametrize("n,k", [(1, 64), (37, 100), (700, 896)])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunked_quantizers_store_the_whole_weights_codes(n, k, group, dtype, monkeypatch):
    monkeypatch.setattr(groupwise, "_CHUNK_ELEMENTS", 4 * k)  # several chunks even for the small weights
    w = weight(n, k)
    assert_same(quantize_int8(w, group, dtype), int8_whole(w, group, dtype))
    for symmetric in (True, False):
        assert_same(quantize_int4(w, group, symmetric, dtype, "rtn"), int4_whole(w, group, symmetric, dtype, "rtn"))
    if n < 100:
        assert_same(quantize_int4(w, group, False, dtype, "mse"), int4_whole(w, group, False, dtype, "mse"))


@pytest.mark.parametrize("rows", [1, 7, 64, 1000])
def test_quantize_blocks_gives_the_whole_weights_codes(rows):
    w = weight(300, 200, seed=3)
    assert_same(quantize_blocks(blocks(w, rows), 300, lambda b: quantize_int8(b, 64, "float32")),
                quantize_int8(w, 64, "float32"))
    for symmetric in (True, False):
        assert_same(quantize_blocks(blocks(w, rows), 300, lambda b: quantize_int4(b, 32, symmetric, "float16", "rtn")),
                    quantize_int4(w, 32, symmetric, "float16", "rtn"))


def test_quantize_blocks_quantizes_only_blocks():
    seen = []

    def quantize(block):
        seen.append(block.shape[0])
        return quantize_int8(block, 32, "float32")

    quantize_blocks(blocks(weight(100, 64), 16), 100, quantize)
    assert seen == [16] * 6 + [4]
    with pytest.raises(ValueError, match="no rows"):
        quantize_blocks(iter(()), 0, quantize)
