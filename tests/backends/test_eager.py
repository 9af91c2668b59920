"""The eager target serves symbolic sizes: one compile with dynamic=True runs every batch
and sequence length, fused as a static compile, at 1e-5 of eager (fp32)."""

import pytest
import torch

import graphopt
from graphopt import models
from tests.helpers import assert_matches_eager, eager

# (batch, sequence) pairs; batch stays above 1 because dynamo specializes a size of 1
SHAPES = [(2, 5), (3, 9), (2, 12)]


def _ids(batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(batch * 100 + length))


@pytest.mark.parametrize("name", ["llama-tiny", "bert-tiny"])
def test_one_dynamic_compile_serves_every_shape(name):
    model = models.build(name, seed=0)
    calls = [_ids(b, n) for b, n in SHAPES]
    torch._dynamo.reset()
    graphopt.reset()
    static = torch.compile(model, backend="graphopt", options={"target": "eager", "fallback": "error"})
    with torch.no_grad():
        static(calls[0])
    (static_report,) = graphopt.reports()
    torch._dynamo.reset()
    graphopt.reset()
    compiled = torch.compile(model, backend="graphopt", dynamic=True, options={"target": "eager", "fallback": "error"})
    with torch.no_grad():
        outputs = [compiled(ids) for ids in calls]
    (report,) = graphopt.reports()  # one graph, one compile, every shape
    assert report.target == "eager" and report.fallbacks == []
    assert report.fused_op_counts() == static_report.fused_op_counts() != {}
    for ids, out in zip(calls, outputs):
        assert_matches_eager(out, eager(model, ids), rel=1e-5)
