"""graphopt.int4_linear and its packing format: nibble order, dequantization, the
reference op against a plain matmul on the dequantized weight, the fake impl, errors."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import graphopt.ops  # noqa: F401  (registers torch.ops.graphopt.*)
from graphopt.ops.quant import check_format, dequantize_int4, pack_int4, unpack_int4

int4_linear = torch.ops.graphopt.int4_linear


def random_int4(n, k, group, symmetric=True, scale_dtype=torch.float16, seed=0):
    """Random codes, non-zero scales (some negative, as the symmetric search makes) and zeros."""
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    codes = torch.randint(0, 16, (n, groups * group), generator=gen, dtype=torch.uint8)
    scales = ((torch.rand(n, groups, generator=gen) + 0.1) * 0.01
              * torch.where(torch.rand(n, groups, generator=gen) < 0.3, -1.0, 1.0)).to(scale_dtype)
    zeros = None if symmetric else pack_int4(torch.randint(0, 16, (n, groups), generator=gen, dtype=torch.uint8))
    return pack_int4(codes), scales, zeros, codes


def test_nibble_order_matches_matmulnbits():
    # Element 2j in the low nibble, 2j + 1 in the high one; an odd tail pads with 0.
    packed = pack_int4(torch.tensor([[1, 2, 3]], dtype=torch.uint8))
    assert packed.tolist() == [[0x21, 0x03]]
    assert unpack_int4(packed, 3).tolist() == [[1, 2, 3]]


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), cols=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_pack_unpack_round_trip(rows, cols, seed):
    codes = torch.randint(0, 16, (rows, cols), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (rows, (cols + 1) // 2) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed, cols), codes)


@pytest.mark.parametrize("symmetric", [True, False])
def test_dequantize_is_code_minus_zero_times_scale(symmetric):
    packed, scales, zeros, codes = random_int4(3, 64, 32, symmetric)
    z = torch.full((3, 2), 8.0) if symmetric else unpack_int4(zeros, 2).float()
    expected = torch.empty(3, 64)
    for n in range(3):
        for k in range(64):
            expected[n, k] = (codes[n, k].float() - z[n, k // 32]) * scales[n, k // 32].float()
    assert torch.equal(dequantize_int4(packed, scales, zeros, 32), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k, group", [(64, 32), (128, 128), (40, 32)], ids=["k64g32", "k128g128", "k40_padded"])
def test_reference_is_linear_on_the_dequantized_weight(dtype, symmetric, bias, k, group):
    packed, scales, zeros, _ = random_int4(24, k, group, symmetric)
    x = torch.randn(2, 3, k).to(dtype)
    b = torch.randn(24).to(dtype) if bias else None
    out = int4_linear(x, packed, scales, zeros, group, b)
    weight = dequantize_int4(packed, scales, zeros, group, k).to(dtype)
    assert out.dtype == dtype and out.shape == (2, 3, 24)
    assert torch.equal(out, F.linear(x, weight, b))
    assert out.abs().sum() > 0


def test_fake_impl_gives_shape_and_dtype():
    packed, scales, zeros, _ = random_int4(48, 96, 32, symmetric=False)
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(5, 96, dtype=torch.float16))
        out = int4_linear(x, mode.from_tensor(packed), mode.from_tensor(scales), mode.from_tensor(zeros), 32, None)
    assert out.shape == (5, 48) and out.dtype == torch.float16


def test_opcheck():
    packed, scales, zeros, _ = random_int4(16, 64, 32, symmetric=False)
    torch.library.opcheck(int4_linear, (torch.randn(3, 64), packed, scales, zeros, 32, torch.randn(16)))


@pytest.mark.parametrize("change, message", [
    (lambda p, s, z: (p[:, :-1], s, z), "need (16, 32)"),
    (lambda p, s, z: (p.to(torch.int8), s, z), "must be 2-D uint8"),
    (lambda p, s, z: (p, s.to(torch.int32), z), "scales must be 2-D float16"),
    (lambda p, s, z: (p, s, z[:, :0]), "zero points must be uint8 (16, 1)"),
])
def test_bad_format_fails_with_one_line(change, message):
    packed, scales, zeros, _ = random_int4(16, 64, 32, symmetric=False)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        int4_linear(torch.randn(2, 64), *change(packed, scales, zeros), 32)


def test_input_width_must_fit_the_groups():
    packed, scales, zeros, _ = random_int4(8, 64, 32)
    with pytest.raises(ValueError, match="input has 20 features"):
        int4_linear(torch.randn(2, 20), packed, scales, zeros, 32)
    assert check_format(packed, scales, zeros, 32, 33) == (8, 2, 64)  # 33..64 all fit two groups
