"""The fused rope + KV-cache write kernel vs the graphopt reference op, under the interpreter."""

from __future__ import annotations

import pytest
import torch

import graphopt.ops  # noqa: F401  (registers torch.ops.graphopt.*)
from graphopt.backends.triton.kernels import rope_cache as rc
from graphopt.ops.kv_cache import cache_shape

from ._numerics import DTYPES, TOLERANCES, assert_matches, randn

ops = torch.ops.graphopt

# (B, Hq, Hkv, Smax, D, R, pos, Snew): a GQA decode step; more query heads than one head
# block (the interpreter's is 4) with D = 24 and partial rotary; a 3-token chunk at the
# cache's end; multi-head attention (Hq == Hkv) with two head blocks of keys.
CASES = [(1, 4, 2, 16, 16, 16, 3, 1), (2, 6, 2, 20, 24, 12, 9, 1), (2, 4, 1, 12, 32, 32, 9, 3),
         (1, 5, 5, 8, 8, 8, 0, 2)]


def _inputs(case, layout, dtype):
    b, hq, hkv, smax, d, r, pos, snew = case
    q, k, v = randn(b, hq, snew, d, dtype=dtype), randn(b, hkv, snew, d, dtype=dtype), randn(b, hkv, snew, d,
                                                                                           dtype=dtype)
    cos, sin = randn(1, snew, r, dtype=dtype), randn(1, snew, r, dtype=dtype)
    k_cache = randn(*cache_shape(layout, b, hkv, smax, d), dtype=dtype)
    v_cache = randn(*cache_shape(layout, b, hkv, smax, d), dtype=dtype)
    return q, k, v, cos, sin, k_cache, v_cache, torch.tensor(pos)


def _check(inputs, layout, interleaved, dtype):
    q, k, v, cos, sin, k_cache, v_cache, pos = inputs
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_q = ops.rope_kv_cache_update(q, k, v, cos, sin, want_k, want_v, pos, layout, interleaved)
    # Poison the cells the update writes: the kernel must overwrite every one of them.
    k_cache[want_k != k_cache] = float("nan")
    v_cache[want_v != v_cache] = float("nan")
    got_q = rc.rope_kv_cache_update(q, k, v, cos, sin, k_cache, v_cache, pos, layout, interleaved)
    assert_matches(got_q, want_q)
    assert_matches(k_cache, want_k)
    torch.testing.assert_close(v_cache, want_v, rtol=0, atol=0)  # values are copied, not computed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("case", CASES)
def test_rope_kv_cache_update(case, layout, dtype):
    _check(_inputs(case, layout, dtype), layout, False, dtype)


@pytest.mark.parametrize("interleaved", [False, True])
def test_interleaved_pairs_and_one_table_per_row(interleaved):
    q, k, v, cos, sin, k_cache, v_cache, pos = _inputs((2, 4, 2, 16, 16, 16, 5, 2), "bhsd", torch.float32)
    cos, sin = randn(2, 2, 16, dtype=torch.float32), randn(2, 2, 16, dtype=torch.float32)  # per batch row
    _check((q, k, v, cos, sin, k_cache, v_cache, pos), "bhsd", interleaved, torch.float32)


def test_fp32_tables_on_an_fp16_model_round_keys_once():
    # HF computes cos/sin in fp32: rope's output is fp32, the cache fp16, one rounding each way.
    q, k, v, _, _, k_cache, v_cache, pos = _inputs(CASES[0], "bhsd", torch.float16)
    cos, sin = randn(1, 1, 16, dtype=torch.float32), randn(1, 1, 16, dtype=torch.float32)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_q = ops.rope_kv_cache_update(q, k, v, cos, sin, want_k, want_v, pos)
    got_q = rc.rope_kv_cache_update(q, k, v, cos, sin, k_cache, v_cache, pos)
    assert got_q.dtype == torch.float32
    assert_matches(got_q, want_q)
    torch.testing.assert_close(k_cache.float(), want_k.float(), **TOLERANCES[torch.float16])


def test_strided_projections_are_read_in_place():
    # q/k/v as views of [B, S, H, D] projections, as a Llama step hands them over.
    q = randn(1, 2, 4, 16, dtype=torch.float32).transpose(1, 2)
    k = randn(1, 2, 2, 16, dtype=torch.float32).transpose(1, 2)
    v = randn(1, 2, 2, 16, dtype=torch.float32).transpose(1, 2)
    cos, sin = randn(1, 2, 16, dtype=torch.float32), randn(1, 2, 16, dtype=torch.float32)
    caches = randn(1, 2, 8, 16, dtype=torch.float32), randn(1, 2, 8, 16, dtype=torch.float32)
    _check((q, k, v, cos, sin, *caches, torch.tensor(3)), "bhsd", False, torch.float32)


def test_tolerance_catches_unrotated_keys():
    q, k, v, cos, sin, k_cache, v_cache, pos = _inputs(CASES[0], "bhsd", torch.float32)
    want_k = k_cache.clone()
    ops.kv_cache_update(want_k, k, pos)  # the keys written without their rotation
    rc.rope_kv_cache_update(q, k, v, cos, sin, k_cache, v_cache, pos)
    with pytest.raises(AssertionError):
        assert_matches(k_cache, want_k)


@pytest.mark.parametrize("change, match", [
    (lambda a: {**a, "v": randn(1, 2, 1, 8, dtype=torch.float32),
                "v_cache": randn(1, 2, 16, 8, dtype=torch.float32)}, "value head dim"),
    (lambda a: {**a, **{n: a[n].to(torch.bfloat16) for n in ("q", "k", "v", "cos", "sin")},
                "k_cache": a["k_cache"].half(), "v_cache": a["v_cache"].half()}, "round twice"),
    (lambda a: {**a, "pos": torch.tensor(16)}, "do not fit"),
    (lambda a: {**a, "layout": "paged"}, "layout"),
], ids=["value-head-dim", "double-rounding", "past-the-end", "paged"])
def test_refuses_what_one_launch_cannot_do_exactly(change, match):
    q, k, v, cos, sin, k_cache, v_cache, pos = _inputs(CASES[0], "bhsd", torch.float32)
    args = change(dict(q=q, k=k, v=v, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache, pos=pos, layout="bhsd"))
    with pytest.raises(ValueError, match=match):
        rc.rope_kv_cache_update(**args)
