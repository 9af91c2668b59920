"""fuse_rope, Before/Expected: the whole graph the pass leaves, node for node
(tests/passes/_before_expected.py), for each way the tables reach the rotation: they are
brought to [B, S, R] for the op."""

import torch
from torch import nn

from tests.helpers import aten_graph
from tests.passes.test_fuse_rope import rotate_every_two, rotate_half
from tests.passes._before_expected import Expected, assert_pass_result

PASS = "fuse_rope"
g, aten = torch.ops.graphopt, torch.ops.aten


class ApplyRotary(nn.Module):
    """transformers' apply_rotary_pos_emb: q and k, tables [B, S, D] unsqueezed at dim 1."""

    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class Rotary(nn.Module):
    def __init__(self, rotate):
        super().__init__()
        self.rotate = rotate

    def forward(self, x, cos, sin):
        return x * cos + self.rotate(x) * sin


def test_q_and_k_each_become_one_op_on_the_unsqueezed_tables():
    before = aten_graph(ApplyRotary(), torch.randn(1, 2, 3, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 3, 4),
                        torch.randn(1, 3, 4))
    b = Expected()
    q, k, cos, sin = b.input((1, 2, 3, 4)), b.input((1, 1, 3, 4)), b.input((1, 3, 4)), b.input((1, 3, 4))
    expected = b.output(b.new(g.rope.default, q, cos, sin, False, by=PASS),
                        b.new(g.rope.default, k, cos, sin, False, by=PASS))
    assert_pass_result(PASS, before, expected, matches=2)


def test_interleaved_pairs_with_four_dim_tables():
    before = aten_graph(Rotary(rotate_every_two), torch.randn(1, 2, 3, 4), torch.randn(1, 1, 3, 4),
                        torch.randn(1, 1, 3, 4))
    b = Expected()
    x, cos, sin = b.input((1, 2, 3, 4)), b.input((1, 1, 3, 4)), b.input((1, 1, 3, 4))
    cos3, sin3 = (b.new(aten.squeeze.dim, t, 1, by=PASS) for t in (cos, sin))
    assert_pass_result(PASS, before, b.output(b.new(g.rope.default, x, cos3, sin3, True, by=PASS)))


def test_two_dim_tables_are_brought_to_batch_seq_dim():
    """[S, D] tables: today the pass unsqueezes them to [1, 1, S, D] and squeezes the head axis
    again, so two of the three nodes per table cancel out (a later cleanup could drop them)."""
    before = aten_graph(Rotary(rotate_half), torch.randn(1, 2, 3, 4), torch.randn(3, 4), torch.randn(3, 4))
    b = Expected()
    x, cos, sin = b.input((1, 2, 3, 4)), b.input((3, 4)), b.input((3, 4))
    tables = []
    for t in (cos, sin):
        t = b.new(aten.unsqueeze.default, b.new(aten.unsqueeze.default, t, 0, by=PASS), 0, by=PASS)
        tables.append(b.new(aten.squeeze.dim, t, 1, by=PASS))
    assert_pass_result(PASS, before, b.output(b.new(g.rope.default, x, *tables, False, by=PASS)))
