"""Flash-attention prefill and flash-decoding kernels vs the graphopt reference op."""

from __future__ import annotations

import pytest
import torch

import graphopt.ops  # noqa: F401  (registers torch.ops.graphopt.*)
from graphopt.backends.triton.kernels import attention as dispatch
from graphopt.backends.triton.kernels import flash_attention as fa
from graphopt.backends.triton.kernels import flash_decoding as fd

from ._numerics import DTYPES, assert_matches, poisoned, randn

ops = torch.ops.graphopt
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

# (B, Hq, Hkv, Sq, Skv, D, Dv). The interpreter's tiles are 16x16, so these cover one
# partial tile; GQA with Sq < Skv (a KV cache) and D = 24; Sq > Skv, where causal rows
# see no key at all (nan, as in the reference); and Dv != D with MQA over 3 KV blocks.
PREFILL = [(1, 2, 2, 5, 5, 16, 16), (2, 4, 2, 7, 19, 24, 24), (1, 6, 2, 33, 20, 32, 16),
           (1, 2, 1, 3, 40, 64, 64)]
# (B, Hq, Hkv, Skv, D, Dv): MHA; GQA 4 over 70 keys; GQA 3 (padded to 16 rows), Dv != D.
DECODE = [(1, 2, 2, 5, 16, 16), (2, 8, 2, 70, 24, 24), (1, 6, 2, 33, 32, 16)]


def _qkv(b, hq, hkv, sq, skv, d, dv, dtype):
    return (randn(b, hq, sq, d, dtype=dtype), randn(b, hkv, skv, d, dtype=dtype),
            randn(b, hkv, skv, dv, dtype=dtype))


def _mask(kind, b, hq, sq, skv, dtype):
    if kind == "bool":  # per-head, with the last key always visible so no row is empty
        m = torch.rand(b, hq, sq, skv) > 0.3
        m[..., -1] = True
        return m
    if kind == "additive":  # [Sq, Skv] broadcast over batch and heads (stride-0 dims)
        return randn(sq, skv, dtype=dtype)
    return None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", PREFILL)
@pytest.mark.parametrize("mask_kind", [None, "bool", "additive"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_flash_attention(shape, dtype, mask_kind, is_causal):
    b, hq, hkv, sq, skv, d, dv = shape
    q, k, v = _qkv(*shape, dtype)
    mask = _mask(mask_kind, b, hq, sq, skv, dtype)
    out = poisoned((b, hq, sq, dv), dtype)
    got = fa.flash_attention(q, k, v, mask, None, is_causal, out=out)
    ref = ops.attention(q, k, v, mask, None, is_causal)
    assert got is out
    # nan only where the reference has it: causal rows that see no key when Sq > Skv.
    assert_matches(got, ref, equal_nan=True)
    assert got.isnan().sum() == ref.isnan().sum()


def test_flash_attention_rows_with_no_visible_key_are_zero_like_the_reference():
    # A left pad's query sees no key: SDPA (and the reference) give 0; nan would reach every
    # later token of the row through the next layer.
    q, k, v = _qkv(1, 2, 2, 4, 6, 16, 16, torch.float32)
    mask = torch.ones(1, 1, 4, 6, dtype=torch.bool)
    mask[..., 2, :] = False
    got = fa.flash_attention(q, k, v, mask)
    assert (got[..., 2, :] == 0).all() and not got.isnan().any()
    assert_matches(got, ops.attention(q, k, v, mask))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_flash_decoding_heads_with_no_visible_key_are_zero_like_the_reference(num_splits):
    q, k, v = _qkv(2, 4, 2, 1, 9, 16, 16, torch.float32)
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    mask[1] = False  # the second sequence sees nothing
    got = fd.flash_decoding(q, k, v, mask, num_splits=num_splits)
    assert (got[1] == 0).all() and not got.isnan().any()
    assert_matches(got, ops.attention(q, k, v, mask))


def test_flash_attention_scale_and_strided_inputs():
    # q/k/v as transposed [B, S, H, D] projections, and an explicit scale.
    q = randn(2, 9, 4, 32, dtype=torch.float32).transpose(1, 2)
    k = randn(2, 12, 2, 32, dtype=torch.float32).transpose(1, 2)
    v = randn(2, 12, 2, 32, dtype=torch.float32).transpose(1, 2)
    assert_matches(fa.flash_attention(q, k, v, None, 0.3, True), ops.attention(q, k, v, None, 0.3, True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", DECODE)
@pytest.mark.parametrize("mask_kind", [None, "bool", "additive"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_flash_decoding(shape, dtype, mask_kind, num_splits):
    b, hq, hkv, skv, d, dv = shape
    q, k, v = _qkv(b, hq, hkv, 1, skv, d, dv, dtype)
    mask = _mask(mask_kind, b, hq, 1, skv, dtype)
    out = poisoned((b, hq, 1, dv), dtype)
    got = fd.flash_decoding(q, k, v, mask, None, num_splits=num_splits, out=out)
    assert got is out
    assert_matches(got, ops.attention(q, k, v, mask, None, True))


def test_flash_decoding_split_that_sees_no_key():
    # Keys 0..47 masked: with 16-key splits the first three splits see nothing and must
    # drop out of the reduction with weight 0, not poison it with nan.
    q, k, v = _qkv(1, 4, 2, 1, 70, 16, 16, torch.float32)
    mask = torch.ones(1, 1, 1, 70, dtype=torch.bool)
    mask[..., :48] = False
    got = fd.flash_decoding(q, k, v, mask, num_splits=5)
    assert_matches(got, ops.attention(q, k, v, mask))


def test_flash_decoding_default_splits():
    q, k, v = _qkv(1, 4, 1, 1, 100, 16, 16, torch.float32)
    assert fd.default_num_splits(1, 100, q.device) > 1  # long cache, few heads: split it
    assert_matches(fd.flash_decoding(q, k, v), ops.attention(q, k, v))


@pytest.mark.parametrize("sq", [1, 4])
def test_attention_dispatch(sq):
    q, k, v = _qkv(1, 4, 2, sq, 20, 16, 16, torch.float32)
    assert_matches(dispatch.attention(q, k, v, None, None, True), ops.attention(q, k, v, None, None, True))


def test_tolerance_catches_a_missing_causal_mask():
    q, k, v = _qkv(1, 2, 2, 8, 8, 16, 16, torch.float32)
    with pytest.raises(AssertionError):
        assert_matches(fa.flash_attention(q, k, v, None, None, False), ops.attention(q, k, v, None, None, True))


def test_empty_kv_gives_zeros_like_the_reference():
    q, k, v = _qkv(1, 2, 2, 3, 0, 16, 16, torch.float32)
    assert_matches(fa.flash_attention(q, k, v), ops.attention(q, k, v))
    assert_matches(fd.flash_decoding(q[:, :, :1], k, v), ops.attention(q[:, :, :1], k, v))


def test_rejects_heads_that_do_not_group():
    q, k, v = _qkv(1, 3, 2, 1, 4, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        dispatch.attention(q, k, v)


@pytest.mark.parametrize("sq", [1, 3])  # decoding and prefill
def test_rejects_k_and_v_of_different_lengths(sq):
    """The fusion relates k's and v's lengths without a guard; the kernels would read v at
    k's length, so the wrapper fails instead, as eager's SDPA does."""
    q, k, _ = _qkv(1, 2, 2, sq, 6, 16, 16, torch.float32)
    v = randn(1, 2, 5, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="k has 6 positions and v 5"):
        dispatch.attention(q, k, v)


# ---------------------------------------------------------------- soft-capped scores (Gemma2, Grok)

CAP = 5.0
# (shape as PREFILL, mask kind, causal): GQA with more keys than queries, causal; Dv != D with
# an additive [Sq, Skv] mask; one partial tile with a boolean mask, causal.
PREFILL_CAPPED = [(PREFILL[1], None, True), (PREFILL[2], "additive", False), (PREFILL[0], "bool", True)]


def _capped_qkv(shape, dtype):
    """q and k tripled: scores reach far past CAP, so a kernel that skipped the cap would fail."""
    q, k, v = _qkv(*shape, dtype)
    return (q.float() * 3).to(dtype), (k.float() * 3).to(dtype), v


def _cap_changes_the_result(q, k, v, mask, is_causal):
    capped, plain = ops.attention(q, k, v, mask, None, is_causal, CAP), ops.attention(q, k, v, mask, None, is_causal)
    with pytest.raises(AssertionError):
        assert_matches(plain, capped, equal_nan=True)
    return capped


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, mask_kind, is_causal", PREFILL_CAPPED)
def test_flash_attention_softcap(shape, mask_kind, is_causal, dtype):
    b, hq, hkv, sq, skv, d, dv = shape
    q, k, v = _capped_qkv(shape, dtype)
    mask = _mask(mask_kind, b, hq, sq, skv, dtype)
    ref = _cap_changes_the_result(q, k, v, mask, is_causal)
    out = poisoned((b, hq, sq, dv), dtype)
    got = fa.flash_attention(q, k, v, mask, None, is_causal, CAP, out=out)
    assert got is out
    assert_matches(got, ref, equal_nan=True)
    assert got.isnan().sum() == ref.isnan().sum()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, mask_kind, num_splits", [(DECODE[1], None, 3), (DECODE[2], "additive", 1)])
def test_flash_decoding_softcap(shape, mask_kind, num_splits, dtype):
    b, hq, hkv, skv, d, dv = shape
    q, k, v = _capped_qkv((b, hq, hkv, 1, skv, d, dv), dtype)
    mask = _mask(mask_kind, b, hq, 1, skv, dtype)
    ref = _cap_changes_the_result(q, k, v, mask, False)
    out = poisoned((b, hq, 1, dv), dtype)
    got = fd.flash_decoding(q, k, v, mask, None, CAP, num_splits=num_splits, out=out)
    assert got is out
    assert_matches(got, ref)


@pytest.mark.parametrize("sq", [1, 4])
def test_graphopt_triton_op_passes_the_cap_to_the_kernel(sq):
    # The graphopt_triton op copies graphopt.attention's schema, softcap included, and must
    # run the kernel (not the reference) for it.
    from graphopt.backends.triton import ops as triton_ops

    op = triton_ops.triton_op("graphopt.attention")
    q, k, v = _capped_qkv((1, 4, 2, sq, 20, 16, 16), torch.float32)
    before = triton_ops.calls[("graphopt.attention", "kernel")]
    got = op(q, k, v, None, 0.3, True, CAP)
    assert triton_ops.calls[("graphopt.attention", "kernel")] == before + 1
    assert_matches(got, ops.attention(q, k, v, None, 0.3, True, CAP))


def test_amd_capped_prefill_tunes_only_tiles_that_do_not_spill():
    # gfx942 spills the tanh's temporaries at 64-key tiles (see prune_configs); NVIDIA and
    # uncapped attention keep every config.
    amd, nvidia = fa.gpu_configs(hip=True), fa.gpu_configs(hip=False)
    kept = fa.prune_configs(amd, {"SOFTCAP": True}, warp=64)
    assert kept and all(c.kwargs["BLOCK_N"] == 32 for c in kept) and len(kept) < len(amd)
    assert fa.prune_configs(amd, {"SOFTCAP": False}, warp=64) == amd
    assert fa.prune_configs(nvidia, {}, warp=32, SOFTCAP=True) == nvidia


# ---------------------------------------------------------------- decoding over a static cache

def _static_cache(layout, int8, dtype, lengths, max_len=48, heads=2, d=16, block=8, seed=0):
    """K and V buffers holding lengths[b] random tokens per row, poisoned past them: NaN in a
    float cache, NaN in an int8 cache's scales, so any read past a length shows in the output."""
    from graphopt.ops.kv_cache import cache_shape, kv_cache_update

    gen = torch.Generator().manual_seed(seed)
    b = len(lengths)
    shape = cache_shape(layout, b, heads, max_len, d, block)
    table = torch.randperm(shape[0], generator=gen).view(b, -1) if layout == "paged" else None
    caches, scales = [], []
    for _ in range(2):
        cache = torch.full(shape, 99, dtype=torch.int8) if int8 else torch.full(shape, float("nan"), dtype=dtype)
        s = torch.full((*shape[:3], 1), float("nan")) if int8 else None
        for row, n in enumerate(lengths):
            new = torch.randn(1, heads, n, d, generator=gen).to(dtype)
            if layout == "paged":
                kv_cache_update(cache, new, torch.tensor(0), layout, table[row:row + 1], s)
            else:
                kv_cache_update(cache[row:row + 1], new, torch.tensor(0), layout, None,
                                None if s is None else s[row:row + 1])
        caches.append(cache)
        scales.append(s)
    return caches, scales, table


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd", "paged"])
def test_cache_attention_reads_each_row_up_to_its_length(layout, int8, dtype):
    """Rows of 5 and 37 valid keys in a 48-position buffer, 3 splits of 16: row 0 needs one
    split, row 1 all three, the last one partly; every position past a length is poison."""
    lengths = torch.tensor([5, 37])
    (kc, vc), (ks, vs), table = _static_cache(layout, int8, dtype, lengths.tolist())
    q = randn(2, 8, 1, 16, dtype=dtype)
    out = poisoned((2, 8, 1, 16), dtype)
    got = fd.cache_attention(q, kc, vc, lengths, layout, table, ks, vs, num_splits=3, out=out)
    assert got is out and torch.isfinite(got).all(), "read a position past a row's length"
    assert_matches(got, ops.cache_attention(q, kc, vc, lengths, layout, table, ks, vs))


def test_cache_attention_takes_one_length_for_every_row_and_a_mask():
    """The graph's lengths are (pos + 1).expand(B): stride 0; a boolean mask over the buffer."""
    (kc, vc), _, _ = _static_cache("bhsd", False, torch.float32, [20, 20])
    kc, vc = kc.nan_to_num(5.0), vc.nan_to_num(5.0)  # the mask, not the length, is what is tested here
    lengths = torch.tensor(20).expand(2)
    mask = torch.rand(1, 1, 1, 48) > 0.4
    mask[..., 0] = True
    q = randn(2, 8, 1, 16, dtype=torch.float32)
    got = fd.cache_attention(q, kc, vc, lengths, mask=mask, num_splits=2)
    assert_matches(got, ops.cache_attention(q, kc, vc, lengths, mask=mask))


@pytest.mark.parametrize("lengths", [[9, 9], [6, 9]], ids=["even", "ragged"])
@pytest.mark.parametrize("layout, int8", [("bhsd", False), ("paged", True)])
def test_cache_attention_chunk_runs_flash_attention_over_the_valid_prefix(layout, int8, lengths):
    """A prompt of 3 queries ending at each row's length (causal per row), poison past it."""
    (kc, vc), (ks, vs), table = _static_cache(layout, int8, torch.float32, lengths)
    n = torch.tensor(lengths)
    q = randn(2, 8, 3, 16, dtype=torch.float32)
    out = poisoned((2, 8, 3, 16), torch.float32)
    got = fd.cache_attention(q, kc, vc, n, layout, table, ks, vs, is_causal=True, out=out)
    assert got is out and torch.isfinite(got).all()
    assert_matches(got, ops.cache_attention(q, kc, vc, n, layout, table, ks, vs, is_causal=True))
