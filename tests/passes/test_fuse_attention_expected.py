"""fuse_attention, Before/Expected: the whole graph the pass leaves, node for node
(tests/passes/_before_expected.py): SDPA (grouped-query heads kept implicit) and the
explicit softmax form each become one graphopt.attention."""

import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import aten_graph
from tests.passes._before_expected import Expected, assert_pass_result

PASS = "fuse_attention"
g = torch.ops.graphopt


class Sdpa(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class Explicit(nn.Module):
    """``softmax(q @ k^T * 0.5 + mask) @ v`` with an additive mask input."""

    def forward(self, q, k, v, mask):
        return torch.softmax(q @ k.transpose(-2, -1) * 0.5 + mask, dim=-1) @ v


def test_sdpa_with_grouped_query_heads_becomes_the_op():
    before = aten_graph(Sdpa(), torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))
    b = Expected()
    q, k, v = b.input((1, 4, 3, 8)), b.input((1, 2, 3, 8)), b.input((1, 2, 3, 8))
    assert_pass_result(PASS, before, b.output(b.new(g.attention.default, q, k, v, None, None, True, by=PASS)))


def test_explicit_form_with_a_mask_becomes_the_op():
    before = aten_graph(Explicit(), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8),
                        torch.randn(1, 1, 3, 3))
    b = Expected()
    q, k, v, mask = b.input((1, 2, 3, 8)), b.input((1, 2, 3, 8)), b.input((1, 2, 3, 8)), b.input((1, 1, 3, 3))
    assert_pass_result(PASS, before, b.output(b.new(g.attention.default, q, k, v, mask, 0.5, False, by=PASS)))
