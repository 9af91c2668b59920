"""canonicalize, Before/Expected: the whole graph the pass leaves, node for node
(tests/passes/_before_expected.py): every identity op goes, every value-changing op stays.
The input graph is written by hand, so each identity op the pass knows is in it (the
torch.export frontend already drops some, such as a same-dtype cast)."""

import torch

from tests.passes._before_expected import Expected, assert_pass_result

PASS = "canonicalize"
aten = torch.ops.aten


def _chain(b: Expected, identities: bool):
    """sin, then (as identities) * 1, + 0, - 0, / 1, a same-dtype cast, a same-shape view, a
    whole slice and an alias, then cos, * 2 and a cast to half; ``* 1`` of the graph output stays."""
    x = b.input((2, 8))
    y = b.op(aten.sin.default, x)
    if identities:
        y = b.op(aten.mul.Tensor, y, 1.0)
        y = b.op(aten.add.Tensor, y, 0)
        y = b.op(aten.sub.Tensor, y, 0.0)
        y = b.op(aten.div.Tensor, y, 1.0)
        y = b.op(aten._to_copy.default, y, dtype=torch.float32)
        y = b.op(aten.view.default, y, [2, 8])
        y = b.op(aten.slice.Tensor, y, 1, 0, 9223372036854775807)
        y = b.op(aten.alias.default, y)
    y = b.op(aten.mul.Tensor, b.op(aten.cos.default, y), 2.0)
    y = b.op(aten._to_copy.default, y, dtype=torch.float16)
    return b.output(b.op(aten.mul.Tensor, y, 1.0))


def test_identity_ops_go_and_the_rest_stays():
    assert_pass_result(PASS, _chain(Expected(), identities=True), _chain(Expected(), identities=False), matches=8)
