"""graphopt.attention -> GroupQueryAttention / MultiHeadAttention / standard ops, and the
KV-cache form (attention over cat(past, new)) -> GroupQueryAttention with past/present."""

from __future__ import annotations

import pytest
import torch

from tests.backends.onnxruntime._helpers import Call, export_and_run, rel_err

go = torch.ops.graphopt
gen = torch.Generator().manual_seed(1)
B, HQ, HKV, S, D = 2, 4, 2, 6, 16
GQA, MHA = "com.microsoft::GroupQueryAttention", "com.microsoft::MultiHeadAttention"


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


def check(fn, *inputs, op: str | None, dynamic_shapes=None, run_inputs=None, cached: int = 0):
    module = Call(lambda s, *a: fn(*a))
    outputs, model = export_and_run(module, *inputs, dynamic_shapes=dynamic_shapes, run_inputs=run_inputs)
    expected = module(*(run_inputs or inputs))
    expected = expected if isinstance(expected, tuple) else (expected,)
    for got, want in zip(outputs, expected):
        assert got.shape == want.shape
        assert rel_err(got, want) < 1e-5, f"relative error {rel_err(got, want):.3g}"
    fused = model.fused_op_counts()
    assert fused == ({op: 1} if op else {}), fused
    assert model.cached_attention == cached


@pytest.mark.parametrize("causal", [True, False])
def test_grouped_heads_same_length_is_group_query_attention(causal):
    check(lambda q, k, v: go.attention(q, k, v, None, None, causal),
          randn(B, HQ, S, D), randn(B, HKV, S, D), randn(B, HKV, S, D), op=GQA)


def test_causal_with_dynamic_batch_and_sequence():
    b, s = torch.export.Dim("batch", max=8), torch.export.Dim("seq", max=64)
    shapes = ({0: b, 2: s},) * 3
    other = (randn(3, HQ, 11, D), randn(3, HKV, 11, D), randn(3, HKV, 11, D))
    check(lambda q, k, v: go.attention(q, k, v, None, 0.3, True), randn(B, HQ, S, D), randn(B, HKV, S, D),
          randn(B, HKV, S, D), op=GQA, dynamic_shapes=shapes, run_inputs=other)


def test_boolean_padding_mask_is_multi_head_attention():
    mask = randn(B, 1, 1, S + 3) > -0.5
    mask[..., 0] = True
    check(lambda q, k, v, m: go.attention(q, k, v, m, None, False),
          randn(B, HQ, S, D), randn(B, HQ, S + 3, D), randn(B, HQ, S + 3, D), mask, op=MHA)


def test_additive_mask_broadcast_from_2d_is_multi_head_attention():
    check(lambda q, k, v, m: go.attention(q, k, v, m, 0.2, False),
          randn(B, HQ, S, D), randn(B, HQ, S + 2, D), randn(B, HQ, S + 2, D), randn(S, S + 2), op=MHA)


def test_grouped_heads_with_a_mask_are_multi_head_attention_over_expanded_kv():
    """A sliding-window model (Mistral) masks its grouped-head attention: MultiHeadAttention
    has no kv_num_heads, so k/v are expanded to the query heads, as repeat_kv did."""
    mask = randn(B, 1, S, S + 3) > -1.0
    check(lambda q, k, v, m: go.attention(q, k, v, m, None, False),
          randn(B, HQ, S, D), randn(B, HKV, S + 3, D), randn(B, HKV, S + 3, D), mask, op=MHA)


@pytest.mark.parametrize("case", ["causal chunk", "causal grouped heads with mask", "value head size differs"])
def test_other_shapes_use_standard_ops(case):
    q, k, v, mask, causal = randn(B, HQ, S, D), randn(B, HKV, S + 3, D), randn(B, HKV, S + 3, D), None, True
    if case == "causal grouped heads with mask":
        mask = randn(B, 1, S, S + 3) > -1.0
    if case == "value head size differs":
        k, v = randn(B, HKV, S, D), randn(B, HKV, S, 8)
    check(lambda q, k, v: go.attention(q, k, v, mask, None, causal), q, k, v, op=None)


def _decode(q, past_k, past_v, k, v, causal=False):
    keys, values = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)
    return go.attention(q, keys, values, None, None, causal), keys, values


def test_decode_over_a_kv_cache_is_group_query_attention_with_past():
    b, past = torch.export.Dim("batch", max=8), torch.export.Dim("past", max=128)
    shapes = ({0: b}, {0: b, 2: past}, {0: b, 2: past}, {0: b}, {0: b})
    inputs = (randn(B, HQ, 1, D), randn(B, HKV, 7, D), randn(B, HKV, 7, D), randn(B, HKV, 1, D), randn(B, HKV, 1, D))
    other = (randn(3, HQ, 1, D), randn(3, HKV, 12, D), randn(3, HKV, 12, D), randn(3, HKV, 1, D), randn(3, HKV, 1, D))
    check(_decode, *inputs, op=GQA, cached=1, dynamic_shapes=shapes, run_inputs=other)


def test_causal_chunk_over_a_cache_with_batch_one_is_group_query_attention():
    inputs = (randn(1, HQ, 3, D), randn(1, HKV, 7, D), randn(1, HKV, 7, D), randn(1, HKV, 3, D), randn(1, HKV, 3, D))
    check(lambda *a: _decode(*a, causal=True), *inputs, op=GQA, cached=1)


def test_skips_cache_form_for_chunks_of_a_batch():
    # ORT's GQA refuses a chunk longer than one token with a past cache when batch > 1.
    inputs = (randn(2, HQ, 3, D), randn(2, HKV, 7, D), randn(2, HKV, 7, D), randn(2, HKV, 3, D), randn(2, HKV, 3, D))
    check(lambda *a: _decode(*a, causal=True), *inputs, op=None, cached=0)


@pytest.mark.parametrize("additive", [False, True], ids=["bool", "additive"])
@pytest.mark.parametrize("heads, causal", [(HQ, False), (HKV, False), (HKV, True)])  # MHA, expanded MHA, standard
def test_a_query_that_attends_to_nothing_is_zero_not_nan(heads, causal, additive):
    """A left-padded row's pad queries see no key: ORT's softmax over -inf was NaN there, and the
    next layer spread it to the row's real tokens; the bias is now finite and such rows zero."""
    mask = torch.ones(B, 1, S, S, dtype=torch.bool)
    mask[1, :, :, :2] = False
    mask[1, :, :2, :] = False  # row 1's first two queries attend to nothing
    if additive:  # the same mask as a -inf bias
        mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    q, k, v = randn(B, HQ, S, D), randn(B, heads, S, D), randn(B, heads, S, D)
    module = Call(lambda s, *a: go.attention(*a, mask, None, causal))
    (out,), _ = export_and_run(module, q, k, v)
    assert not out.isnan().any() and out[1, :, :2].abs().max() == 0
    assert rel_err(out, module(q, k, v)) < 1e-5
