"""static_kv_cache, Before/Expected: the whole graph the pass leaves, node for node
(tests/passes/_before_expected.py): attention over two caches grown by cat becomes two
in-place writes at a new position input and cache_attention over the static buffers; the
concatenated caches leave the outputs."""

import torch
import torch.nn.functional as F

from tests.passes._before_expected import Expected, assert_pass_result
from tests.passes.test_static_kv_cache import export_step

PASS = "static_kv_cache"
g, aten = torch.ops.graphopt, torch.ops.aten
MAX = 8


class CatCacheAttention(torch.nn.Module):
    def forward(self, q, k_new, v_new, past):
        k, v = torch.cat([past[0], k_new], dim=-2), torch.cat([past[1], v_new], dim=-2)
        return F.scaled_dot_product_attention(q, k, v), k, v


def test_a_decode_step_writes_in_place_and_attends_over_the_static_buffers():
    q, k, v = (torch.randn(1, 2, 1, 4) for _ in range(3))
    before = export_step(CatCacheAttention(), q, k, v, past=[torch.randn(1, 2, 5, 4) for _ in range(2)])
    b = Expected()
    q, k, v = (b.input((1, 2, 1, 4)) for _ in range(3))
    k_cache, v_cache = b.input((1, 2, MAX, 4)), b.input((1, 2, MAX, 4))
    pos = b.input((), torch.int64)
    b.new(g.kv_cache_update.default, k_cache, k, pos, "bhsd", None, None, by=PASS)
    b.new(g.kv_cache_update.default, v_cache, v, pos, "bhsd", None, None, by=PASS)
    lengths = b.new(aten.expand.default, b.new(aten.add.Tensor, pos, 1, by=PASS), [1], by=PASS)
    out = b.new(g.cache_attention.default, q, k_cache, v_cache, lengths, "bhsd", None, None, None, None, None, False,
                0.0, by=PASS)
    assert_pass_result(PASS, before, b.output(out), matches=2, max_length=MAX)
