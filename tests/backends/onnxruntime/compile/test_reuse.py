"""graph_instance.instance_of, as the onnxruntime target's session reuse uses it: a graph is
served by an earlier dynamic graph's session only when it is that graph with its symbols
bound to its own sizes; any other difference means a new export."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from graphopt.frontend.graph_instance import describe, instance_of


def traced(fn, *inputs, symbolic: bool):
    return make_fx(fn, tracing_mode="symbolic" if symbolic else "fake", _allow_non_fake_inputs=True)(*inputs)


def project(weight, scale=2.0):
    def fn(x):
        b, s, d = x.shape
        return (x.reshape(b * s, d) @ weight * scale).view(b, s, -1).relu()
    return fn


def test_a_static_graph_is_an_instance_of_its_dynamic_twin():
    w = torch.randn(8, 4)
    dynamic = traced(project(w), torch.randn(3, 5, 8), symbolic=True)
    static = traced(project(w), torch.randn(1, 6, 8), symbolic=False)
    binding = instance_of(dynamic, static)
    assert binding is not None and sorted(binding.values()) == [1, 6]
    assert "= 1" in describe(binding) and "= 6" in describe(binding)


def test_a_graph_that_fixes_only_the_batch_binds_the_other_symbol_to_its_own():
    w = torch.randn(8, 4)
    dynamic = traced(project(w), torch.randn(3, 5, 8), symbolic=True)
    partly = traced(lambda x: project(w)(x[:1]), torch.randn(1, 7, 8), symbolic=True)
    assert instance_of(dynamic, partly) is None  # an extra slice: not the same ops
    also_dynamic = traced(project(w), torch.randn(4, 9, 8), symbolic=True)
    binding = instance_of(dynamic, also_dynamic)
    assert binding is not None and all(v.is_Symbol for v in binding.values())


def test_other_weights_constants_or_dtypes_are_not_instances():
    w = torch.randn(8, 4)
    dynamic = traced(project(w), torch.randn(3, 5, 8), symbolic=True)
    x = torch.randn(1, 6, 8)
    assert instance_of(dynamic, traced(project(w + 1e-3), x, symbolic=False)) is None  # weights
    assert instance_of(dynamic, traced(project(w, scale=3.0), x, symbolic=False)) is None  # a constant
    assert instance_of(dynamic, traced(project(w.double()), x.double(), symbolic=False)) is None  # dtype
    assert instance_of(dynamic, traced(project(w.clone()), x, symbolic=False)) is not None  # equal copy


def test_a_more_general_graph_is_not_an_instance_of_a_static_one():
    w = torch.randn(8, 4)
    static = traced(project(w), torch.randn(1, 6, 8), symbolic=False)
    dynamic = traced(project(w), torch.randn(3, 5, 8), symbolic=True)
    assert instance_of(static, dynamic) is None


def test_sizes_must_agree_under_the_binding():
    """Same ops, but the second graph's view size is not the first's under the binding."""
    dynamic = traced(lambda x: x.view(x.shape[0] * x.shape[1]).sin(), torch.randn(3, 5), symbolic=True)
    other = traced(lambda x: x.view(x.shape[0] * x.shape[1]).sin(), torch.randn(1, 6), symbolic=False)
    assert instance_of(dynamic, other) is not None
    halves = traced(lambda x: x.view(2, 3).sin(), torch.randn(1, 6), symbolic=False)
    assert instance_of(dynamic, halves) is None  # a [2, 3] view is not [s0 * s1]
