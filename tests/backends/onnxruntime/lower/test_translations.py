"""Each graphopt op lowers to ONNX Runtime's fused op and matches its reference.

Every test exports a small graph that calls the op directly (independent of the fusion
passes), runs it in an InferenceSession on seeded random non-zero data, compares with the
op's reference implementation, and checks the ONNX model holds the fused op.
"""

from __future__ import annotations

import pytest
import torch

from tests.backends.onnxruntime._helpers import Call, export_and_run, rel_err

go = torch.ops.graphopt
TOL = 1e-5
gen = torch.Generator().manual_seed(0)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


def check(module, *inputs, fused: dict[str, int], tol: float = TOL, **kwargs):
    outputs, model = export_and_run(module, *inputs, **kwargs)
    expected = module(*(kwargs.get("run_inputs") or inputs))
    expected = expected if isinstance(expected, (tuple, list)) else (expected,)
    assert len(outputs) == len(expected)
    for got, want in zip(outputs, expected):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert rel_err(got, want) < tol, f"relative error {rel_err(got, want):.3g}"
    histogram = model.op_histogram()
    for op, count in fused.items():
        assert histogram.get(op, 0) == count, f"expected {count} x {op}, got {histogram}"
    return model


@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
def test_rms_norm_is_simplified_layer_normalization(weight_offset):
    m = Call(lambda s, x: go.rms_norm(x, s.w, 1e-6, weight_offset), w=randn(64) * 0.1 + 1)
    check(m, randn(2, 5, 64), fused={"SimplifiedLayerNormalization": 1})


def test_rms_norm_without_weight():
    check(Call(lambda s, x: go.rms_norm(x, None, 1e-5)), randn(3, 32), fused={"SimplifiedLayerNormalization": 1})


def test_rms_norm_with_mixed_dtypes_keeps_the_reference_rounding():
    m = Call(lambda s, x: go.rms_norm(x, s.w, 1e-5, 1.0), w=randn(64).double())
    check(m, randn(2, 4, 64), fused={"SimplifiedLayerNormalization": 1})


def test_add_rms_norm_is_skip_simplified_layer_normalization():
    m = Call(lambda s, x, r: go.add_rms_norm(x, r, s.w, 1e-5), w=randn(64) + 1)
    model = check(m, randn(2, 5, 64), randn(2, 5, 64), fused={"com.microsoft::SkipSimplifiedLayerNormalization": 1})
    assert "Add" not in model.op_histogram()


def test_add_rms_norm_of_rank_4_adds_first():
    m = Call(lambda s, x, r: go.add_rms_norm(x, r, s.w, 1e-5, 1.0), w=randn(16))
    check(m, randn(2, 3, 4, 16), randn(2, 3, 4, 16), fused={"SimplifiedLayerNormalization": 1, "Add": 1})


def test_softmax_rms_norm():
    m = Call(lambda s, x: go.softmax_rms_norm(x, s.w, 1e-6), w=randn(8) + 1)
    check(m, randn(4, 6, 8) * 3, fused={"Softmax": 1, "SimplifiedLayerNormalization": 1})


def test_layer_norm():
    m = Call(lambda s, x: go.layer_norm(x, s.w, s.b, 1e-12), w=randn(64) + 1, b=randn(64))
    check(m, randn(2, 5, 64), fused={"LayerNormalization": 1})


def test_layer_norm_without_affine():
    check(Call(lambda s, x: go.layer_norm(x, None, None, 1e-5)), randn(2, 5, 64), fused={"LayerNormalization": 1})


def test_add_layer_norm_is_skip_layer_normalization():
    m = Call(lambda s, x, r: go.add_layer_norm(x, r, s.w, s.b, 1e-12), w=randn(64) + 1, b=randn(64))
    check(m, randn(2, 5, 64), randn(2, 5, 64), fused={"com.microsoft::SkipLayerNormalization": 1})


@pytest.mark.parametrize("approximate,op", [("none", "com.microsoft::BiasGelu"), ("tanh", "com.microsoft::FastGelu")])
def test_bias_gelu(approximate, op):
    m = Call(lambda s, x: go.bias_gelu(x, s.b, approximate), b=randn(48))
    check(m, randn(2, 5, 48) * 2, fused={op: 1})


def test_gelu_without_bias():
    check(Call(lambda s, x: go.bias_gelu(x, None, "none")), randn(3, 40), fused={"com.microsoft::Gelu": 1})


def test_swiglu():
    check(Call(lambda s, x: go.swiglu(x)), randn(2, 5, 64) * 2, fused={"Split": 1, "Sigmoid": 1})


@pytest.mark.parametrize("approximate,op", [("none", "com.microsoft::Gelu"), ("tanh", "com.microsoft::FastGelu")])
def test_geglu(approximate, op):
    check(Call(lambda s, x: go.geglu(x, approximate)), randn(2, 5, 64) * 2, fused={op: 1})


@pytest.mark.parametrize("with_bias", [False, True])
def test_qkv_proj_is_one_matmul(with_bias):
    bias = randn(64 + 16 + 16) if with_bias else None
    weights = {"w": randn(96, 32) * 0.2, **({"b": bias} if with_bias else {})}
    m = Call(lambda s, x: tuple(go.qkv_proj(x, s.w, getattr(s, "b", None), [64, 16, 16])), **weights)
    check(m, randn(2, 5, 32), fused={"MatMul": 1, "Slice": 3})


def _tables(batch: int, seq: int, rot: int, interleaved: bool, offset: torch.Tensor):
    positions = torch.arange(seq).float()[None] + offset[:, None]
    freqs = positions[..., None] / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    table = freqs.repeat_interleave(2, -1) if interleaved else torch.cat([freqs, freqs], -1)
    return table.cos(), table.sin()


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot", [16, 8])  # full and partial rotary
def test_rope_is_rotary_embedding(interleaved, rot):
    # Per-row position offsets: positions are read from the tables, never assumed.
    cos, sin = _tables(2, 5, rot, interleaved, torch.tensor([0.0, 7.0]))
    m = Call(lambda s, x, c, si: go.rope(x, c, si, interleaved))
    check(m, randn(2, 4, 5, 16), cos, sin, fused={"com.microsoft::RotaryEmbedding": 1})


def test_rope_with_dynamic_batch_and_sequence():
    cos, sin = _tables(2, 5, 16, False, torch.tensor([0.0, 3.0]))
    b, s = torch.export.Dim("batch", max=8), torch.export.Dim("seq", max=64)
    m = Call(lambda s_, x, c, si: go.rope(x, c, si, False))
    other = (randn(3, 4, 9, 16), *_tables(3, 9, 16, False, torch.tensor([1.0, 0.0, 5.0])))
    check(m, randn(2, 4, 5, 16), cos, sin, fused={"com.microsoft::RotaryEmbedding": 1},
          dynamic_shapes=({0: b, 2: s}, {0: b, 1: s}, {0: b, 1: s}), run_inputs=other)
