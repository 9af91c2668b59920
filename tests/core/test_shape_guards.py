"""graphopt's rewrites never specialise a symbolic graph behind dynamo's back.

A pass that compares a symbolic size (``size != 1``) adds a guard to the compiled graph, and
the first input that breaks it recompiles: a batch of 1 after a dynamic batch, a decode step
after a prefill. With ``backed_size_oblivious`` dynamo itself adds no 0/1 guard, so one compile
serves batch 1 too, unless a pass adds one. These tests hold every default pass to "no
guard", and check that a pass which does add one is named in the report.
"""

from dataclasses import dataclass

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental import _config as fx_config

import graphopt
from graphopt import models
from graphopt.pass_manager import PassResult
from tests.helpers import assert_matches_eager

SHAPES = [(1, 5), (3, 9), (1, 12), (2, 7)]  # batch 1 between dynamic batches: the 0/1 case


def compile_and_call(module, target: str, pipeline=None):
    torch._dynamo.reset()
    graphopt.reset()
    options = {"target": target}
    if pipeline is not None:
        options["pipeline"] = pipeline
    compiled = torch.compile(module, backend="graphopt", dynamic=True, options=options)
    calls = [models.example_inputs(module, batch=b, seq_len=s, seed=s) for b, s in SHAPES]
    with torch.no_grad(), fx_config.patch(backed_size_oblivious=True):
        outputs = [compiled(*args) for args in calls]
    return calls, outputs, graphopt.reports()


@pytest.mark.parametrize("target", ["eager", "onnxruntime"])
def test_default_pipeline_adds_no_shape_guard(target):
    model = models.build("llama-tiny")
    calls, outputs, reports = compile_and_call(model, target)
    assert len(reports) == 1, f"one compile for batch 1 and 3 at four lengths, got {len(reports)}"
    report = reports[0]
    assert report.target == target and report.fallbacks == []
    assert not [n for n in report.notes if "specialised" in n], report.notes
    assert report.fused_op_counts().get("graphopt.attention", 0) > 0  # the fusions still fired
    with torch.no_grad():
        for args, out in zip(calls, outputs):
            want, got = model(*args), out
            want = want[0] if isinstance(want, tuple) else want
            got = got[0] if isinstance(got, tuple) else got
            assert_matches_eager(got, want, rel=1e-4)


@dataclass
class _NoOptions:
    pass


class SpecialisesOnBatch:
    """A planted pass that asks whether the batch is 1: the guard it adds must be reported."""

    name = "test_specialises_on_batch"
    summary = "compares a symbolic size (planted)"
    Options = _NoOptions
    requires = ()

    def run(self, gm: fx.GraphModule, ctx) -> PassResult:
        for node in gm.graph.nodes:
            value = node.meta.get("val")
            if node.op == "placeholder" and isinstance(value, torch.Tensor) and value.dim() == 2:
                bool(value.shape[0] != 1)  # a plain comparison: becomes a guard
        return PassResult(gm, modified=False, stats={"matches": 0})


def test_a_pass_that_adds_a_guard_is_named_in_the_report():
    planted = SpecialisesOnBatch()
    with graphopt.scoped_passes(planted):
        _, _, reports = compile_and_call(models.build("llama-tiny"), "eager", pipeline=[planted.name])
    notes = [n for r in reports for n in r.notes if "specialised" in n]
    assert notes and "test_shape_guards.py" in notes[0], notes
    assert len(reports) >= 2, "the guard it added made batch 1 recompile"


class SpecialisesOnBothAxes(SpecialisesOnBatch):
    """Planted: two guards on one graph, as a decoder's layers add one each. Every call's
    length passes both, so one compile serves them all."""

    name = "test_specialises_on_both_axes"

    def run(self, gm: fx.GraphModule, ctx) -> PassResult:
        for node in gm.graph.nodes:
            value = node.meta.get("val")
            if node.op == "placeholder" and isinstance(value, torch.Tensor) and value.dim() == 2:
                bool(value.shape[1] > 3)
                bool(value.shape[1] < 100)
        return PassResult(gm, modified=False, stats={"matches": 0})


def test_many_added_guards_are_one_log_line_and_each_a_note(caplog):
    planted = SpecialisesOnBothAxes()
    with graphopt.scoped_passes(planted), caplog.at_level("WARNING", logger="graphopt"):
        _, _, reports = compile_and_call(models.build("llama-tiny"), "eager", pipeline=[planted.name])
    assert len(reports) == 1, "every length passes both guards"
    notes = [n for n in reports[0].notes if "specialised" in n]
    assert len(notes) == 2 and all("test_shape_guards.py" in n for n in notes), reports[0].notes
    lines = [r.getMessage() for r in caplog.records if "specialised" in r.getMessage()]
    assert len(lines) == 1 and "2 size relations" in lines[0] and "test_shape_guards.py" in lines[0], lines
