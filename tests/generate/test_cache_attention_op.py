"""graphopt.cache_attention: attention over a static cache that reads only each row's valid positions."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import graphopt.ops  # noqa: F401  (registers the ops)
from graphopt.ops import attention as A
from graphopt.ops.kv_cache import cache_shape, kv_cache_update, read_cache

B, HQ, H, D, MAX, BLOCK = 2, 4, 2, 8, 12, 4
LENGTHS = torch.tensor([5, 10])  # rows of different lengths, neither a whole block
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _filled(layout, int8, seed=0):
    """Caches with LENGTHS[b] random tokens per row and NaN (fp32) or int8 garbage past them."""
    gen = torch.Generator().manual_seed(seed)
    shape = cache_shape(layout, B, H, MAX, D, BLOCK)
    table = torch.randperm(shape[0], generator=gen).view(B, -1) if layout == "paged" else None
    caches, scales = [], []
    for _ in range(2):
        cache = torch.full(shape, 77, dtype=torch.int8) if int8 else torch.full(shape, float("nan"))
        s = torch.full((*shape[:3], 1), float("nan")) if int8 else None
        for b in range(B):
            row = torch.randn(1, H, int(LENGTHS[b]), D, generator=gen)
            one = table[b:b + 1] if table is not None else None
            if layout == "paged":
                kv_cache_update(cache, row, torch.tensor(0), layout, one, s)
            else:  # write row b only: the others keep their poison
                view = cache[b:b + 1]
                kv_cache_update(view, row, torch.tensor(0), layout, None, None if s is None else s[b:b + 1])
        caches.append(cache)
        scales.append(s)
    return caches, scales, table


def _expected(q, caches, scales, table, layout, mask=None, is_causal=False):
    """Row by row: plain attention over exactly that row's valid positions."""
    rows = []
    for b in range(B):
        n = int(LENGTHS[b])
        one = table[b:b + 1] if table is not None else None
        kv = []
        for c, s in zip(caches, scales):
            if layout == "paged":
                kv.append(read_cache(c, layout, one, s, length=n))
            else:
                kv.append(read_cache(c[b:b + 1], layout, None, None if s is None else s[b:b + 1], length=n))
        m = None if mask is None else mask[..., :n]
        rows.append(A.attend(q[b:b + 1], *kv, m, None, is_causal))
    return torch.cat(rows)


@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd", "paged"])
def test_reads_only_each_rows_valid_positions(layout, int8):
    (kc, vc), (ks, vs), table = _filled(layout, int8)
    q = torch.randn(B, HQ, 1, D, generator=torch.Generator().manual_seed(5))
    got = torch.ops.graphopt.cache_attention(q, kc, vc, LENGTHS, layout, table, ks, vs)
    assert torch.isfinite(got).all(), "read a poisoned position past a row's length"
    torch.testing.assert_close(got, _expected(q, (kc, vc), (ks, vs), table, layout), **TOL)


def test_causal_chunk_aligns_each_row_to_its_own_end():
    (kc, vc), _, _ = _filled("bhsd", False)
    q = torch.randn(B, HQ, 3, D, generator=torch.Generator().manual_seed(6))
    got = torch.ops.graphopt.cache_attention(q, kc, vc, LENGTHS, is_causal=True)
    torch.testing.assert_close(got, _expected(q, (kc, vc), (None, None), None, "bhsd", is_causal=True), **TOL)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_a_mask_over_the_whole_buffer_is_read_over_the_valid_positions(kind):
    (kc, vc), _, _ = _filled("bhsd", False)
    q = torch.randn(B, HQ, 1, D, generator=torch.Generator().manual_seed(7))
    keep = torch.rand(1, 1, 1, MAX, generator=torch.Generator().manual_seed(8)) > 0.3
    keep[..., 0] = True  # every row keeps a key
    mask = keep if kind == "bool" else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    got = torch.ops.graphopt.cache_attention(q, kc, vc, LENGTHS, mask=mask)
    torch.testing.assert_close(got, _expected(q, (kc, vc), (None, None), None, "bhsd", mask=mask), **TOL)


def test_traced_it_masks_the_whole_buffer_and_computes_the_same():
    """Under make_fx (fake lengths) nothing can be read on the host: the graph masks every row
    over the whole buffer, which must agree with the sliced eager result."""
    (kc, vc), _, _ = _filled("bhsd", False)
    kc, vc = kc.nan_to_num(3.0), vc.nan_to_num(3.0)  # a finite tail: the masked form multiplies it by 0
    q = torch.randn(B, HQ, 1, D, generator=torch.Generator().manual_seed(9))
    fn = lambda q, k, v, n: torch.ops.graphopt.cache_attention(q, k, v, n)  # noqa: E731
    traced = make_fx(lambda *a: A.cache_attention._init_fn(*a), tracing_mode="fake")(q, kc, vc, LENGTHS)
    assert not any("item" in str(n.target) or "_local_scalar" in str(n.target) for n in traced.graph.nodes)
    torch.testing.assert_close(traced(q, kc, vc, LENGTHS), fn(q, kc, vc, LENGTHS), **TOL)


@pytest.mark.parametrize("call, message", [
    (lambda q, c: A.cache_attention(q, c, c, torch.tensor([3])), "lengths must be int"),
    (lambda q, c: A.cache_attention(q, c, c, torch.tensor([3.0, 4.0])), "lengths must be int"),
    (lambda q, c: A.cache_attention(q, c, c, torch.tensor([3, 4]), "paged"), "block_table"),
    (lambda q, c: A.cache_attention(q, c.to(torch.int8), c.to(torch.int8), torch.tensor([3, 4])), "scales"),
    (lambda q, c: A.cache_attention(q, c, c, torch.tensor([3, 4]), "bsdh"), "layout"),
])
def test_bad_arguments_fail_with_one_line(call, message):
    q, c = torch.randn(B, HQ, 1, D), torch.randn(B, H, MAX, D)
    with pytest.raises(ValueError, match=message) as info:
        call(q, c)
    assert "\n" not in str(info.value)
