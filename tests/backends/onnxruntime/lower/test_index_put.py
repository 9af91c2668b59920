"""aten.index_put with an index on every axis lowers to one ScatterND, without onnx-ir's
"Attribute type is ambiguous" warning; other forms keep torchlib's translation."""

from __future__ import annotations

import logging

import torch

from tests.backends.onnxruntime._helpers import Call, export_and_run

AMBIGUOUS = "Attribute type is ambiguous"


def inverse_permutation(s, perm):
    """The planted MoE block's unsort (graphopt.fuzz.patterns_moe), which raised the warning."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.size(0), device=perm.device)
    return inv


def export_quietly(caplog, module, *inputs):
    with caplog.at_level(logging.WARNING):
        outputs, model = export_and_run(module, *inputs)
    assert not [r for r in caplog.records if AMBIGUOUS in r.getMessage()]
    want = module(*inputs)
    want = want if isinstance(want, tuple) else (want,)
    for got, expected in zip(outputs, want):
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    return model


def test_inverse_permutation_is_one_scatter_and_warns_nothing(caplog):
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    model = export_quietly(caplog, Call(inverse_permutation), perm)
    histogram = model.op_histogram()
    assert histogram.get("ScatterND") == 1 and "Transpose" not in histogram and "Gather" not in histogram


def test_every_axis_indexed_and_accumulated():
    def fn(s, x, i, j, v):
        return x.index_put((i, j), v, accumulate=True)

    g = torch.Generator().manual_seed(1)
    x, v = torch.randn(5, 6, generator=g), torch.randn(4, generator=g)
    i, j = torch.tensor([0, 2, 2, 4]), torch.tensor([1, 3, 3, 5])  # a repeated pair: the adds must both land
    outputs, model = export_and_run(Call(fn), x, i, j, v)
    assert torch.allclose(outputs[0], fn(None, x, i, j, v), atol=1e-6)
    assert model.op_histogram().get("ScatterND") == 1


def test_an_axis_left_unindexed_keeps_torchlibs_translation():
    def fn(s, x, i, rows):
        return x.index_put((i,), rows)

    g = torch.Generator().manual_seed(2)
    x, rows = torch.randn(6, 8, generator=g), torch.randn(2, 8, generator=g)
    i = torch.tensor([4, 1])
    outputs, _ = export_and_run(Call(fn), x, i, rows)
    assert torch.equal(outputs[0], fn(None, x, i, rows))
