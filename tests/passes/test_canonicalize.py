"""canonicalize: identity ops go, anything that changes a value stays."""

import torch
from torch import nn

import graphopt

from tests.helpers import assert_matches_eager, compile_with_graphopt, count, eager


class Identities(nn.Module):
    def forward(self, x):
        y = torch.sin(x) * 1.0
        y = (y + 0) / 1.0
        return torch.cos(y.to(torch.float32))


def test_removes_identity_ops():
    x = torch.randn(4, 8)
    out, report = compile_with_graphopt(Identities(), x, passes=["canonicalize"])
    assert report.passes[0].matches >= 3
    assert set(report.op_counts) == {"aten.sin", "aten.cos"}
    assert_matches_eager(out, eager(Identities(), x), rel=0)


class RealOps(nn.Module):
    def forward(self, x):
        return (x * 2.0 + 1).to(torch.float16), x * 1.0  # the second is an output: kept


def test_skips_value_changing_ops_and_graph_outputs():
    x = torch.randn(4, 8)
    out, report = compile_with_graphopt(RealOps(), x, passes=["canonicalize"])
    assert count(report, "aten.mul") == 2 and count(report, "aten._to_copy") == 1
    assert_matches_eager(out, eager(RealOps(), x), rel=0)


class Broadcasting(nn.Module):
    def forward(self, x, ones):
        return torch.relu(x * ones)  # ones broadcasts x up: not an identity


def test_skips_multiply_that_broadcasts():
    x, ones = torch.randn(8), torch.ones(3, 8)
    out, report = compile_with_graphopt(Broadcasting(), x, ones, passes=["canonicalize"])
    assert count(report, "aten.mul") == 1
    assert_matches_eager(out, eager(Broadcasting(), x, ones), rel=0)


class Views(nn.Module):
    """Each projection views x to x's own shape (what a DTensor layer's input hook traces to)."""

    def forward(self, x):
        return torch.sin(x.view(4, 8)) + torch.cos(x.view(4, 8)), torch.tanh(x.view(8, 4))


def test_removes_same_shape_views_and_keeps_reshapes():
    x = torch.randn(4, 8)
    out, report = compile_with_graphopt(Views(), x, passes=["canonicalize"])
    assert report.passes[0].matches == 2
    assert count(report, "aten.view") == 1  # the [8, 4] reshape changes the shape: kept
    assert_matches_eager(out, eager(Views(), x), rel=0)


def test_sizes_are_compared_without_guards_even_when_data_dependent():
    """An expert loop's gathered rows have data-dependent sizes; comparing two of them with
    ``==`` raised (and on backed sizes would add a guard). Equal only when known equal."""
    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from graphopt.passes.canonicalize import _same_value_shape

    env = ShapeEnv()
    u0, u1 = env.create_unbacked_symint(), env.create_unbacked_symint()
    with FakeTensorMode(shape_env=env):
        a, b = torch.empty(u0, 8), torch.empty(u1, 8)
    graph = fx.Graph()
    na, nb, na2 = graph.placeholder("a"), graph.placeholder("b"), graph.placeholder("a2")
    na.meta["val"], nb.meta["val"], na2.meta["val"] = a, b, a.view(u0, 8)
    assert not _same_value_shape(na, nb)  # maybe equal at run time: not an identity
    assert _same_value_shape(na, na2)
    assert not env.guards


class Slices(nn.Module):
    """``x[:, None]`` slices the first axis whole; the others change the value."""

    def forward(self, x):
        whole = torch.sin(x[:, None])
        return whole, torch.cos(x[1:]), torch.tanh(x[::2]), torch.exp(x[:, :2])


def test_removes_whole_slices_of_a_dynamic_axis_and_keeps_the_others():
    """A static trace drops ``x[:]`` itself, a dynamic one keeps it (the end is sys.maxsize,
    not the size): dropped here, the dynamic graph is the static graph with sizes as symbols."""
    x = torch.randn(6, 4)
    torch._dynamo.reset()
    graphopt.reset()
    compiled = torch.compile(Slices(), backend="graphopt", dynamic=True, fullgraph=True,
                             options={"target": "eager", "fallback": "error", "pipeline": ["canonicalize"]})
    with torch.no_grad():
        out = compiled(x)
    (report,) = graphopt.reports()
    assert report.passes[0].matches == 2  # x[:, None] and x[:, :2] each slice axis 0 whole
    assert count(report, "aten.slice") == 3  # x[1:], x[::2], x[:, :2]
    assert_matches_eager(out, eager(Slices(), x), rel=0)
