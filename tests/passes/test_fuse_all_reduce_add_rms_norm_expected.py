"""fuse_all_reduce_add_rms_norm, Before/Expected: the whole graph the pass leaves, node for
node (tests/passes/_before_expected.py). Both graphs are written by hand, so no process
group is needed: the pass reads the group's name, never the group."""

import operator

import pytest
import torch

import graphopt.ops.collectives  # noqa: F401  (registers graphopt::all_reduce_add_rms_norm)
from tests.passes._before_expected import Expected, assert_pass_result

PASS = "fuse_all_reduce_add_rms_norm"
g, c10d = torch.ops.graphopt, torch.ops._c10d_functional
WEIGHT = 1 + 0.1 * torch.randn(8, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("reduced_first", [True, False], ids=["reduced_first", "residual_first"])
def test_all_reduce_add_and_norm_become_one_op(reduced_first):
    b = Expected()
    partial, residual, w = b.input((2, 8)), b.input((2, 8)), b.const("weight", WEIGHT)
    reduced = b.op(c10d.wait_tensor.default, b.op(c10d.all_reduce.default, partial, "sum", "tp"))
    operands = (reduced, residual) if reduced_first else (residual, reduced)
    norm = b.op(g.add_rms_norm.default, *operands, w, 1e-6, 0.0)
    before = b.output(b.op(operator.getitem, norm, 0), b.op(operator.getitem, norm, 1))

    e = Expected()
    partial, residual, w = e.input((2, 8)), e.input((2, 8)), e.const("weight", WEIGHT)
    fused = e.new(g.all_reduce_add_rms_norm.default, partial, residual, w, 1e-6, "tp", 0.0, by=PASS)
    expected = e.output(e.op(operator.getitem, fused, 0), e.op(operator.getitem, fused, 1))
    assert_pass_result(PASS, before, expected)
