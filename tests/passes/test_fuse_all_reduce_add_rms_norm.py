"""fuse_all_reduce_add_rms_norm on a one-rank gloo group (the all-reduce is then an identity,
so the graph and its numerics are checkable in-process); the two-rank sums are checked by
tests/distributed/test_tensor_parallel.py."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.helpers import assert_matches_eager, compile_with_graphopt, count, eager

PIPE = ["canonicalize", "fuse_rms_norm", "fuse_add_rms_norm", "fuse_all_reduce_add_rms_norm"]
FUSED = "graphopt.all_reduce_add_rms_norm"
c10d = torch.ops._c10d_functional


@pytest.fixture(scope="module")
def group_name():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


def rms_norm(h, weight, eps=1e-6):
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))


class RowParallelThenNorm(nn.Module):
    """``s = x + all_reduce(h @ W^T)``; returns (norm(s), s): a row-parallel projection."""

    def __init__(self, group, op="sum", reduced_first=True, extra_reader=False, hidden=32):
        super().__init__()
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(hidden))
        self.group, self.op, self.reduced_first, self.extra_reader = group, op, reduced_first, extra_reader

    def forward(self, x, h):
        reduced = c10d.wait_tensor(c10d.all_reduce(self.proj(h), self.op, self.group))
        s = reduced + x if self.reduced_first else x + reduced
        out = rms_norm(s, self.weight)
        return (out, s, reduced * 2) if self.extra_reader else (out, s)


def inputs():
    torch.manual_seed(1)
    return torch.randn(2, 5, 32), torch.randn(2, 5, 32)


@pytest.mark.parametrize("reduced_first", [True, False])
def test_fuses_all_reduce_add_and_norm(group_name, reduced_first):
    torch.manual_seed(0)
    module = RowParallelThenNorm(group_name, reduced_first=reduced_first)
    out, report = compile_with_graphopt(module, *inputs(), passes=PIPE)
    assert count(report, FUSED) == 1
    assert count(report, "graphopt.add_rms_norm") == 0
    assert count(report, "_c10d_functional.all_reduce") == 0
    assert count(report, "_c10d_functional.wait_tensor") == 0
    assert_matches_eager(out, eager(module, *inputs()), rel=1e-6)


@pytest.mark.parametrize("kwargs, reason", [
    ({"op": "max"}, "reduces with 'max'; the fused op sums"),
    ({"extra_reader": True}, "is read by 2 nodes; the fused op keeps it inside"),
])
def test_skips_when_the_reduced_value_is_not_a_plain_sum_for_the_norm(group_name, kwargs, reason):
    torch.manual_seed(0)
    module = RowParallelThenNorm(group_name, **kwargs)
    out, report = compile_with_graphopt(module, *inputs(), passes=PIPE)
    assert count(report, FUSED) == 0
    assert count(report, "graphopt.add_rms_norm") == 1  # the add + norm still fuse without the reduce
    assert count(report, "_c10d_functional.all_reduce") == 1  # the collective stays in place
    reasons = [m.reason for m in report.near_misses if m.pass_name == "fuse_all_reduce_add_rms_norm"]
    assert any(reason in r for r in reasons), reasons
    assert_matches_eager(out, eager(module, *inputs()), rel=1e-6)


def test_fused_op_matches_its_reference_chain(group_name):
    torch.manual_seed(2)
    x, residual, w = torch.randn(3, 16), torch.randn(3, 16), torch.randn(16)
    y, s = torch.ops.graphopt.all_reduce_add_rms_norm(x, residual, w, 1e-5, group_name)
    want_y, want_s = torch.ops.graphopt.add_rms_norm(x, residual, w, 1e-5)
    torch.testing.assert_close(s, want_s, rtol=0, atol=0)
    torch.testing.assert_close(y, want_y, rtol=1e-6, atol=1e-6)


class SecondCollectiveBeforeTheNorm(RowParallelThenNorm):
    """Another all-reduce runs between this one and the norm: fusing would reorder them."""

    def forward(self, x, h):
        reduced = c10d.wait_tensor(c10d.all_reduce(self.proj(h), "sum", self.group))
        other = c10d.wait_tensor(c10d.all_reduce(h * 3, "sum", self.group))
        s = reduced + x
        return rms_norm(s, self.weight), s, other


def test_skips_when_another_collective_sits_between(group_name):
    torch.manual_seed(0)
    module = SecondCollectiveBeforeTheNorm(group_name)
    out, report = compile_with_graphopt(module, *inputs(), passes=PIPE)
    assert count(report, FUSED) == 0
    assert count(report, "_c10d_functional.all_reduce") == 2
    reasons = [m.reason for m in report.near_misses if m.pass_name == "fuse_all_reduce_add_rms_norm"]
    assert any("sits between all_reduce" in r for r in reasons), reasons
    assert_matches_eager(out, eager(module, *inputs()), rel=1e-6)
