"""fuse_rope_kv_cache_update, Before/Expected: the whole graph the pass leaves, node for node
(tests/passes/_before_expected.py): a static-cache layer's two rotations and two cache
writes become one op at the first write; the lengths and the attention stay."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from tests.passes._before_expected import Expected, assert_pass_result
from tests.passes.test_fuse_rope_kv_cache_update import _layer, _layer_inputs

PASS = "fuse_rope_kv_cache_update"
g, aten = torch.ops.graphopt, torch.ops.aten


def test_rotations_and_writes_become_one_op():
    before = make_fx(_layer())(*_layer_inputs())
    b = Expected()
    q, k, v = b.input((1, 4, 1, 16)), b.input((1, 2, 1, 16)), b.input((1, 2, 1, 16))
    cos, sin = b.input((1, 1, 16)), b.input((1, 1, 16))
    k_cache, v_cache, pos = b.input((1, 2, 8, 16)), b.input((1, 2, 8, 16)), b.input((), torch.int64)
    q_rot = b.new(g.rope_kv_cache_update.default, q, k, v, cos, sin, k_cache, v_cache, pos, "bhsd", False, by=PASS)
    lengths = b.op(aten.expand.default, b.op(aten.add.Tensor, pos, 1), [1])
    assert_pass_result(PASS, before, b.output(b.op(g.cache_attention.default, q_rot, k_cache, v_cache, lengths)))
