"""Dynamo's batch-1 retrace of a dynamic graph runs the code compiled for that graph.

Under dynamo's default a batch of 1 after a dynamic batch is a new graph (its guard
``2 <= batch`` fails). When that graph is the dynamic one with the batch at 1, graphopt serves
it with the earlier compiled code: no AOT trace, no passes, no build, the same outputs as
eager. Anything else compiles as before.
"""

from __future__ import annotations

import pytest
import torch

import graphopt
from graphopt import models
from tests.helpers import assert_matches_eager, eager


@pytest.fixture
def aot_traces(monkeypatch):
    """How many graphs went through AOT autograd."""
    import torch._functorch.aot_autograd as aot

    count = []
    real = aot.aot_module_simplified

    def spy(*args, **kwargs):
        count.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(aot, "aot_module_simplified", spy)
    return count


def compile_fresh(module, target: str):
    torch._dynamo.reset()
    graphopt.reset()
    return torch.compile(module, backend="graphopt", options={"target": target, "fallback": "error"})


def call_checked(compiled, model, batch: int, seq: int) -> None:
    (ids,) = models.example_inputs(model, batch=batch, seq_len=seq, seed=seq)
    with torch.no_grad():
        assert_matches_eager(compiled(ids), eager(model, ids), rel=1e-4)


@pytest.mark.parametrize("target", ["eager", "onnxruntime"])
def test_a_batch_of_one_after_a_dynamic_batch_runs_the_dynamic_graphs_code(target, aot_traces):
    model = models.build("llama-tiny")
    compiled = compile_fresh(model, target)
    for batch, seq in ((2, 5), (3, 7), (1, 9), (1, 4)):
        call_checked(compiled, model, batch, seq)
    reports = graphopt.reports()
    assert len(reports) == 3  # static, dynamic, the batch-1 retrace
    assert len(aot_traces) == 2  # the retrace skipped AOT autograd and the passes
    served = reports[2]
    assert served.builds == [] and served.passes == []
    assert any(n.startswith("served by graph 1's compiled code") and "= 1" in n for n in served.notes), served.notes
    assert served.fused_op_counts() == reports[1].fused_op_counts()
    assert "size mismatch" in served.recompile_reason or "2 <= " in served.recompile_reason  # the guard that failed


def test_a_replaced_weight_is_not_served_by_code_that_froze_the_old_one(aot_traces):
    model = models.build("llama-tiny")
    compiled = compile_fresh(model, "eager")
    for batch, seq in ((2, 5), (3, 7)):
        call_checked(compiled, model, batch, seq)
    head = model.lm_head if hasattr(model, "lm_head") else model.output
    head.weight = torch.nn.Parameter(torch.randn_like(head.weight), requires_grad=False)
    call_checked(compiled, model, 1, 9)  # eager uses the new weight; so must the compiled graph
    assert len(aot_traces) == 3
    assert not any("served by" in n for r in graphopt.reports() for n in r.notes)


class BranchesOnBatch(torch.nn.Module):
    """Takes another path for a batch of 1: the retrace is not the dynamic graph at batch 1."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.proj(x)
        if x.shape[0] == 1:
            y = y * 2
        return y.relu()


def test_a_retrace_that_differs_from_the_dynamic_graph_compiles_as_before(aot_traces):
    model = BranchesOnBatch().eval()
    compiled = compile_fresh(model, "eager")
    with torch.no_grad():
        for batch, seq in ((2, 3), (3, 5), (1, 4)):
            x = torch.randn(batch, seq, 8)
            torch.testing.assert_close(compiled(x), model(x))
    assert len(aot_traces) == 3
    assert not any("served by" in n for r in graphopt.reports() for n in r.notes)
