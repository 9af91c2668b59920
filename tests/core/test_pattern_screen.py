"""PatternPass.screen: anchors dismissed before matching still reach --why, grouped by reason."""

from __future__ import annotations

import torch

from graphopt.cli import debug_print
from graphopt.pass_manager import PassContext
from graphopt.rewrite import PatternPass, is_op
from tests.helpers import aten_graph

aten = torch.ops.aten


class _NegOfExp(PatternPass):
    """neg(exp(x)) -> nothing: only counts matches; muls without an exp operand are screened."""

    name = "neg_of_exp"
    summary = "test pass"
    anchors = (aten.neg.default,)

    def screen(self, anchor):
        return None if is_op(anchor.args[0], aten.exp.default) else "operand is no exp"

    def match(self, anchor, options):
        return anchor

    def rewrite(self, gm, match, options):
        pass


class _Model(torch.nn.Module):
    def forward(self, x):
        return torch.neg(torch.exp(x)) + torch.neg(x) + torch.neg(x * 2)


def test_screened_anchors_are_recorded_but_not_counted_as_near_misses():
    gm = aten_graph(_Model(), torch.randn(3))
    result = _NegOfExp().run(gm, PassContext())
    assert result.stats["matches"] == 1
    screened = [m for m in result.near_misses if m.screened]
    assert [m.reason for m in screened] == ["operand is no exp"] * 2
    assert not [m for m in result.near_misses if not m.screened]


def test_why_groups_screened_anchors_by_reason(capsys):
    g = {"graph": 0, "passes": [{"name": "neg_of_exp", "matches": 1}],
         "near_misses": [{"pass_name": "neg_of_exp", "anchor": f"neg_{i}", "node": f"neg_{i}",
                          "reason": "operand is no exp", "screened": True} for i in range(5)]}
    debug_print.print_why(g, ["neg_of_exp"])
    out = capsys.readouterr().out
    assert "neg_of_exp: 1 rewrites, 0 near misses, 5 anchors screened out" in out
    assert out.count("operand is no exp") == 1  # one row for the reason, not five
    assert "neg_0, neg_1, neg_2, ..." in out
