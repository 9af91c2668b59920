"""The triton target serves symbolic sizes: one dynamic=True compile, every call at a new
batch/sequence length runs the Triton kernels (they take sizes at run time) and matches
eager. Interpreted on the CPU (conftest sets TRITON_INTERPRET=1); fp32, relative error
1e-5 on whole outputs. Shapes stay tiny: the interpreter runs kernels in Python."""

from __future__ import annotations

import torch

import graphopt
from graphopt import models
from graphopt.backends.triton import ops, registry
from graphopt.backends.triton import target as T
from tests.helpers import assert_matches_eager, eager

TRITON = {"target": "triton", "fallback": "error"}


def _compile_dynamic(module, calls, options=TRITON):
    """One dynamic=True compile, run at every input tuple; (outputs, report, kernel calls per call)."""
    torch._dynamo.reset()
    graphopt.reset()
    compiled = torch.compile(module, backend="graphopt", dynamic=True, options=options)
    outputs, ran = [], []
    with torch.no_grad():
        for args in calls:
            before = ops.calls.copy()
            outputs.append(compiled(*args))
            ran.append(ops.calls - before)
    reports = graphopt.reports()
    assert len(reports) == 1, f"one compile must serve every shape, got {len(reports)}"
    return outputs, reports[0], ran


def test_llama_at_two_sequence_lengths_runs_the_kernels_from_one_compile():
    model = models.build("llama-tiny", seed=0)
    # batch 2: dynamo specializes a size of 1, which would cost a recompile of its own
    calls = [(torch.randint(0, 256, (2, n), generator=torch.Generator().manual_seed(n)),) for n in (5, 11)]
    outputs, report, ran = _compile_dynamic(model, calls)
    assert report.target == "triton" and report.fallbacks == []
    kernels = {(op, "kernel"): n for op, n in report.fused_op_counts().items() if op in registry.lowered_ops()}
    assert kernels[("graphopt.attention", "kernel")] == len(model.layers)
    assert ran == [kernels, kernels], "every lowered op ran as its kernel at each length, none on its reference"
    for (ids,), out in zip(calls, outputs):
        assert_matches_eager(out, eager(model, ids), rel=1e-5)


class NormMLP(torch.nn.Module):
    """RMSNorm then a SwiGLU MLP: two kernels around two matmuls Inductor compiles."""

    def __init__(self, d: int = 16, hidden: int = 32):
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(d) + 0.5)
        self.gate, self.up = torch.nn.Linear(d, hidden, bias=False), torch.nn.Linear(d, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
        return self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h)) + x


def test_gpu_path_compiles_the_rest_with_inductor_symbolically(monkeypatch):
    """As on a GPU (interpreted kernels stand in for compiled ones): Inductor compiles the
    rest of the graph once for symbolic sizes, so a new length needs no new build."""
    monkeypatch.setattr(T, "interpreting", lambda: False)
    monkeypatch.setattr(T, "_on_gpu", lambda gm, inputs: True)
    monkeypatch.setattr(T, "_on_gpu_node", lambda node: True)
    monkeypatch.setattr(T.triton, "unavailable_reason", lambda config: None)
    module = NormMLP()
    calls = [(torch.randn(2, n, 16, generator=torch.Generator().manual_seed(n)),) for n in (3, 7)]
    outputs, report, ran = _compile_dynamic(module, calls)
    assert "triton: the rest of the graph compiled by Inductor" in report.notes, report.notes
    assert report.fused_op_counts() == {"graphopt.rms_norm": 1, "graphopt.swiglu": 1}
    assert ran == [{("graphopt.rms_norm", "kernel"): 1, ("graphopt.swiglu", "kernel"): 1}] * 2
    for (x,), out in zip(calls, outputs):
        assert_matches_eager(out, eager(module, x), rel=1e-5)
