"""graphopt.attention with soft-capped scores on ONNX Runtime: GroupQueryAttention's ``softcap``
where GQA fits (with the mask as its ``attention_bias``), standard ops with a Tanh elsewhere
(MultiHeadAttention has no softcap), and the KV-cache form. Every case is checked against
the reference op on data whose scores the cap really changes."""

from __future__ import annotations

import pytest
import torch

from tests.backends.onnxruntime._helpers import Call, export_and_run, rel_err

go = torch.ops.graphopt
gen = torch.Generator().manual_seed(3)
B, HQ, HKV, S, D = 2, 4, 2, 6, 16
CAP = 5.0
GQA = "com.microsoft::GroupQueryAttention"


def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * std


def qk(*shape: int) -> torch.Tensor:
    """q or k scaled up so that |q k^T * scale| reaches well past CAP: the cap matters."""
    return randn(*shape, std=3.0)


def softcaps(model) -> list[float]:
    """The softcap attribute of every GroupQueryAttention node (0.0 where it is absent)."""
    caps = []
    for node in model.model.graph:
        if node.op_type == "GroupQueryAttention":
            attr = node.attributes.get("softcap")
            caps.append(attr.value if attr is not None else 0.0)
    return caps


def check(fn, *inputs, fused: dict, caps: list[float]):
    module = Call(lambda s, *a: fn(*a))
    outputs, model = export_and_run(module, *inputs)
    expected = module(*inputs)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for got, want in zip(outputs, expected):
        assert got.shape == want.shape
        assert rel_err(got, want) < 1e-5, f"relative error {rel_err(got, want):.3g}"
    assert model.fused_op_counts() == fused, model.fused_op_counts()
    assert softcaps(model) == caps
    return model


def _cap_matters(q, k, v, mask, scale, causal):
    capped = go.attention(q, k, v, mask, scale, causal, CAP)
    assert rel_err(go.attention(q, k, v, mask, scale, causal), capped) > 0.1  # else the test could not fail


@pytest.mark.parametrize("mask_kind", ["none", "additive", "bool"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_heads", [HKV, HQ], ids=["gqa", "mha_heads"])
def test_same_length_is_group_query_attention_with_softcap(mask_kind, causal, kv_heads):
    q, k, v = qk(B, HQ, S, D), qk(B, kv_heads, S, D), randn(B, kv_heads, S, D)
    mask = {"none": None, "additive": randn(B, 1, S, S), "bool": randn(B, 1, 1, S) > -0.5}[mask_kind]
    if mask_kind == "bool":
        mask[..., 0] = True  # every row sees a key: ORT and the reference disagree only on all -inf rows
    _cap_matters(q, k, v, mask, 0.3, causal)
    args = (q, k, v) + ((mask,) if mask is not None else ())
    check(lambda q, k, v, *m: go.attention(q, k, v, m[0] if m else None, 0.3, causal, CAP), *args,
          fused={GQA: 1}, caps=[CAP])


def test_without_softcap_gqa_keeps_the_default():
    check(lambda q, k, v: go.attention(q, k, v, None, None, True), qk(B, HQ, S, D), qk(B, HKV, S, D),
          randn(B, HKV, S, D), fused={GQA: 1}, caps=[0.0])


@pytest.mark.parametrize("case", ["mha_heads_padding_mask", "value_head_size_differs", "query_shorter"])
def test_other_shapes_cap_with_standard_ops(case):
    # A padding mask over more keys than queries would be MultiHeadAttention without a cap:
    # MHA has no softcap attribute, so these run MatMul / Tanh / Softmax / MatMul.
    q, k, v, mask, causal = qk(B, HQ, S, D), qk(B, HQ, S + 3, D), randn(B, HQ, S + 3, D), None, False
    if case == "mha_heads_padding_mask":
        mask = randn(B, 1, 1, S + 3) > -0.5
        mask[..., 0] = True
    if case == "value_head_size_differs":
        k, v = qk(B, HKV, S, D), randn(B, HKV, S, 8)
    if case == "query_shorter":
        causal = True
    _cap_matters(q, k, v, mask, None, causal)
    model = check(lambda q, k, v: go.attention(q, k, v, mask, None, causal, CAP), q, k, v, fused={}, caps=[])
    assert model.op_histogram().get("Tanh") == 1


def test_decode_over_a_kv_cache_is_group_query_attention_with_past_and_softcap():
    def decode(q, past_k, past_v, k, v):
        keys, values = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)
        return go.attention(q, keys, values, None, None, False, CAP), keys, values

    inputs = (qk(B, HQ, 1, D), qk(B, HKV, 7, D), randn(B, HKV, 7, D), qk(B, HKV, 1, D), randn(B, HKV, 1, D))
    keys, values = torch.cat(inputs[1:4:2], 2), torch.cat(inputs[2:5:2], 2)
    _cap_matters(inputs[0], keys, values, None, None, False)
    model = check(decode, *inputs, fused={GQA: 1}, caps=[CAP])
    assert model.cached_attention == 1
