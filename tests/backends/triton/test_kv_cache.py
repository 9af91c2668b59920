"""KV-cache update kernel vs the graphopt reference op, every layout, under the interpreter."""

from __future__ import annotations

import pytest
import torch

import graphopt.ops  # noqa: F401  (registers torch.ops.graphopt.*)
from graphopt.backends.triton.kernels import kv_cache as kc
from graphopt.ops.kv_cache import cache_shape

from ._numerics import DTYPES, randn

ops = torch.ops.graphopt

# (B, H, Smax, D, pos, Snew): a one-token decode write, a 5-token chunk at the end of
# the cache with D = 24 (not a power of two), and a prefill over several programs.
CASES = [(1, 2, 16, 8, 3, 1), (2, 3, 40, 24, 35, 5), (2, 2, 64, 64, 7, 21)]


def _caches(layout, b, h, smax, d, dtype, block_size=8):
    cache = randn(*cache_shape(layout, b, h, smax, d, block_size), dtype=dtype)
    table = None
    if layout == "paged":  # sequences own shuffled blocks of the pool
        per_seq = -(-smax // block_size)
        table = torch.randperm(b * per_seq).reshape(b, per_seq).to(torch.int32)
    return cache, table


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd", "paged"])
@pytest.mark.parametrize("case", CASES)
def test_kv_cache_update(case, layout, dtype):
    b, h, smax, d, pos, snew = case
    cache, table = _caches(layout, b, h, smax, d, dtype)
    new = randn(b, h, snew, d, dtype=dtype)
    expected = cache.clone()
    ops.kv_cache_update(expected, new, torch.tensor(pos), layout, table)
    # Poison the cells the update writes: the kernel must overwrite every one of them.
    cache[expected != cache] = float("nan")
    kc.kv_cache_update(cache, new, torch.tensor(pos), layout, table)
    # A copy is exact: every cell, written or untouched, must be bit-identical.
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["bhsd", "bshd", "paged"])
def test_int8_cache_quantizes_like_the_reference(layout):
    b, h, smax, d, pos, snew = 2, 3, 24, 40, 5, 6
    cache, table = _caches(layout, b, h, smax, d, torch.float32)
    cache = torch.randint(-127, 128, cache.shape, dtype=torch.int8)
    scales = torch.rand(*cache.shape[:3], 1)
    new = randn(b, h, snew, d, dtype=torch.float16, scale=3.0)
    new[0, 0, 0] = 0.0  # an all-zero row keeps a tiny scale and quantizes to zeros
    expected, expected_scales = cache.clone(), scales.clone()
    ops.kv_cache_update(expected, new, torch.tensor(pos), layout, table, expected_scales)
    kc.kv_cache_update(cache, new, torch.tensor(pos), layout, table, scales)
    torch.testing.assert_close(scales, expected_scales, rtol=1e-6, atol=0)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)


def test_rounds_half_to_even_like_torch():
    # Rows whose max is 127 make the scale exactly 1, so x / s hits exact .5 ties.
    new = torch.tensor([[[[127.0, 2.5, -2.5, 3.5, 0.5, -0.5, 126.5, 1.0]]]])
    cache, scales = torch.zeros(1, 1, 4, 8, dtype=torch.int8), torch.zeros(1, 1, 4, 1)
    expected, expected_scales = cache.clone(), scales.clone()
    ops.kv_cache_update(expected, new, torch.tensor(1), "bhsd", None, expected_scales)
    kc.kv_cache_update(cache, new, torch.tensor(1), "bhsd", None, scales)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)


def test_casts_new_rows_to_the_cache_dtype_and_takes_an_int_position():
    cache = randn(1, 2, 8, 16, dtype=torch.float16)
    new = randn(1, 2, 3, 16, dtype=torch.float32)
    expected = cache.clone()
    ops.kv_cache_update(expected, new, torch.tensor(4))
    kc.kv_cache_update(cache, new, 4)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)


def test_reads_strided_new_rows_into_a_cache_slot_of_a_pool():
    pool = randn(2, 2, 2, 10, 16, dtype=torch.float32)  # [B, slot, H, S, D]: the cache is strided
    new = randn(2, 3, 2, 16, dtype=torch.float32).transpose(1, 2)  # a [B, S, H, D] projection
    expected = pool.clone()
    ops.kv_cache_update(expected[:, 1], new, torch.tensor(6))
    kc.kv_cache_update(pool[:, 1], new, torch.tensor(6))
    torch.testing.assert_close(pool, expected, rtol=0, atol=0)


def test_rejects_positions_past_the_end():
    with pytest.raises(ValueError, match="do not fit"):
        kc.kv_cache_update(torch.zeros(1, 1, 4, 8), torch.ones(1, 1, 2, 8), 3)


def test_tunes_per_number_of_new_tokens():
    """A prompt's hundreds of tokens and a decode step's one want different BLOCK_S: the first
    call's choice must not stick to the other."""
    assert {"new_len", "head_dim", "PAGED", "QUANT"} <= set(kc.kv_cache_update_tuned.keys)
