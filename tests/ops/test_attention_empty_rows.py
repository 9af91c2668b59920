"""graphopt.attention for a query that may attend to nothing (a left pad's row under a padding
mask): zeros, as torch's SDPA gives, not softmax's NaN, which the next layer would spread to
every token of the row through 0 * V."""

import pytest
import torch
import torch.nn.functional as F

go = torch.ops.graphopt


def _inputs():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 5, 8, generator=gen) for h in (4, 2, 2))
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    mask[1, :, :, :2] = False  # row 1 is left-padded by two: its first two queries see no key
    return q, k, v, mask


@pytest.mark.parametrize("additive", [False, True])
def test_a_query_that_attends_to_nothing_is_zero(additive):
    q, k, v, mask = _inputs()
    m = torch.zeros(mask.shape).masked_fill(~mask, float("-inf")) if additive else mask
    out = go.attention(q, k, v, m, None, False)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
    assert not out.isnan().any()
    assert out[1, :, :2].abs().max() == 0
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_skips_zeroing_a_row_that_sees_a_key():
    q, k, v, mask = _inputs()
    out = go.attention(q, k, v, mask, None, False)
    assert out[1, :, 2:].abs().min() > 0 and out[0].abs().min() > 0
