"""graphopt's block format (graphopt/ops/quant_blocks.py): the formula, exact widening and
concatenation, and the two ops' references against a dense float computation."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from graphopt.ops.quant_blocks import BlockFormat, BlockQuantized, concatenate, pack_codes, pack_zero_points


def random_blocks(n: int, k: int, fmt: BlockFormat, seed: int = 0) -> BlockQuantized:
    """Random codes, scales, zero points and offsets in ``fmt`` (non-zero, both signs)."""
    rng = np.random.default_rng(seed)
    groups = k // fmt.group_size
    codes = rng.integers(0, 1 << fmt.bits, (n, groups, fmt.group_size), dtype=np.uint8)
    zeros = rng.integers(0, 1 << fmt.bits, (n, groups), dtype=np.uint8) if fmt.zeros else None
    return BlockQuantized(fmt.bits, fmt.group_size, k, fmt.zeros, fmt.offsets, codes=pack_codes(codes, fmt.bits),
                          scales=rng.standard_normal((n, groups)).astype(np.float32) * 0.02,
                          zeros=pack_zero_points(zeros, fmt.bits) if zeros is not None else None,
                          offsets=rng.standard_normal((n, groups)).astype(np.float32) * 0.01)


FORMATS = [BlockFormat(4, 32, False, False), BlockFormat(4, 32, True, True), BlockFormat(8, 32, False, False),
           BlockFormat(8, 32, False, True), BlockFormat(8, 16, False, False), BlockFormat(4, 16, True, False)]


def reference(blocks: BlockQuantized) -> np.ndarray:
    """The formula written out element by element from the unpacked tensors."""
    n, groups = blocks.scales.shape
    q = blocks.unpacked_codes().astype(np.float64)
    z = blocks.zero_points()[..., None] if blocks.zeros is not None else float(1 << (blocks.bits - 1))
    w = (q - z) * blocks.scales[..., None]
    if blocks.offsets is not None:
        w = w + blocks.offsets[..., None]
    return w.reshape(n, groups * blocks.group_size)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_dequantize_is_the_formula(fmt):
    blocks = random_blocks(6, 64, fmt)
    assert np.allclose(blocks.dequantize(), reference(blocks), rtol=1e-6, atol=1e-7)
    assert blocks.format == fmt


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_widening_keeps_every_value_bit_for_bit(fmt):
    blocks = random_blocks(5, 64, fmt, seed=1)
    target = fmt.widened(BlockFormat(8, 16, True, True))
    wide = blocks.widen(target)
    assert wide.format == target
    assert np.array_equal(wide.dequantize(), blocks.dequantize())


def test_widening_refuses_what_would_round():
    blocks = random_blocks(2, 64, BlockFormat(8, 16, False, False))
    with pytest.raises(ValueError, match="cannot write"):
        blocks.widen(BlockFormat(4, 16, False, False))  # fewer bits
    with pytest.raises(ValueError, match="cannot write"):
        blocks.widen(BlockFormat(8, 32, False, False))  # a larger block cannot hold two scales


def test_concatenation_of_mixed_formats_is_exact_and_lazy():
    a = random_blocks(4, 64, BlockFormat(8, 32, False, False), seed=2)  # Q5_0 / Q8_0-like
    b = random_blocks(3, 64, BlockFormat(4, 32, True, True), seed=3)  # Q4_K-like
    joined = concatenate([a, b])
    assert joined.format == BlockFormat(8, 32, True, True)
    assert np.array_equal(joined.dequantize(), np.concatenate([a.dequantize(), b.dequantize()]))
    calls = []
    lazy = BlockQuantized(4, 32, 64, False, False, codes=lambda: calls.append("codes") or a.codes,
                          scales=lambda: calls.append("scales") or a.scales)
    assert lazy.scales is a.scales and calls == ["scales"]  # reading the scales leaves the codes unread


def test_concatenation_refuses_different_widths():
    with pytest.raises(ValueError, match="different widths"):
        concatenate([random_blocks(2, 64, FORMATS[0]), random_blocks(2, 32, FORMATS[0])])


def torch_parts(blocks: BlockQuantized):
    as_torch = lambda a: torch.from_numpy(np.ascontiguousarray(a)) if a is not None else None  # noqa: E731
    return [as_torch(getattr(blocks, name)) for name in ("codes", "scales", "zeros", "offsets")]


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_quantized_linear_reference_multiplies_by_the_dequantized_weight(fmt):
    blocks = random_blocks(8, 64, fmt, seed=4)
    x = torch.randn(3, 5, 64)
    bias = torch.randn(8)
    out = torch.ops.graphopt.quantized_linear(x, *torch_parts(blocks), fmt.bits, fmt.group_size, bias)
    expected = F.linear(x, torch.from_numpy(blocks.dequantize()), bias)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_quantized_gather_reads_only_the_rows_asked_for(fmt):
    blocks = random_blocks(10, 64, fmt, seed=5)
    ids = torch.tensor([[3, 0, 9], [9, 9, 1]])
    out = torch.ops.graphopt.quantized_gather(*torch_parts(blocks), ids, fmt.bits, fmt.group_size, torch.float32)
    expected = F.embedding(ids, torch.from_numpy(blocks.dequantize()))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_fake_implementations_give_shapes_and_check_the_format():
    blocks = random_blocks(8, 64, FORMATS[1])
    parts = torch_parts(blocks)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        out = torch.ops.graphopt.quantized_linear(torch.empty(7, 64), *parts, 4, 32)
        assert tuple(out.shape) == (7, 8)
        with pytest.raises(ValueError, match="do not make 48 input features"):
            torch.ops.graphopt.quantized_linear(torch.empty(7, 48), *parts, 4, 32)
