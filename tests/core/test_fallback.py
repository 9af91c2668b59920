"""A failing pass is skipped, a failing target falls back to eager; both are reported,
and fallback="error" raises instead."""

import dataclasses
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import graphopt
from graphopt import targets
from graphopt.registry import scoped_passes
from graphopt.errors import BackendFailed
from graphopt.pass_manager import NoOptions, PassResult
from graphopt.targets import Compiled
from tests.helpers import assert_matches_eager, eager


@dataclass
class ExplodingPass:
    """A pass that half-rewrites the graph, then raises."""

    name: str = "explode"
    summary: str = "breaks on purpose (tests)"
    Options: type = NoOptions
    requires: tuple = ()

    def run(self, gm, ctx):
        for node in list(gm.graph.nodes):
            if node.op == "call_function":
                node.args = ()  # damage the graph first: the fallback must not keep it
                break
        raise RuntimeError("boom")


class BrokenTarget:
    name = "tensorrt"

    def unavailable_reason(self, config):
        return None

    def compile(self, gm, example_inputs, config):
        raise RuntimeError("cannot lower aten.mm")


class FailsAtRunTarget:
    name = "tensorrt"

    def unavailable_reason(self, config):
        return None

    def compile(self, gm, example_inputs, config):
        def run(*args):
            raise RuntimeError("kernel launch failed")
        return Compiled(run)


class CollectiveFailsAtRunTarget(FailsAtRunTarget):
    def compile(self, gm, example_inputs, config):
        def run(*args):
            raise torch.distributed.DistBackendError("[gloo] Connection closed by peer [127.0.0.1]:29500")
        return Compiled(run)


broken = BrokenTarget()
fails_at_run = FailsAtRunTarget()
collective_fails_at_run = CollectiveFailsAtRunTarget()


class Norm(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) + 1


@pytest.fixture
def exploding_pass():
    with scoped_passes(ExplodingPass()):
        yield


def _compile(module, options):
    torch._dynamo.reset()
    graphopt.reset()
    return torch.compile(module, backend="graphopt", options=options)


def test_failing_pass_is_skipped_and_reported(exploding_pass, caplog):
    x = torch.randn(3, 8)
    with torch.no_grad():
        out = _compile(Norm(), {"target": "eager", "pipeline": ["explode", "fuse_rms_norm"]})(x)
    assert_matches_eager(out, eager(Norm(), x), rel=1e-6)
    (report,) = graphopt.reports()
    assert report.fallbacks == [{"where": "pass:explode", "reason": "RuntimeError: boom"}]
    assert [p.status for p in report.passes] == ["failed", "changed"]  # later passes still run
    assert report.op_counts["graphopt.rms_norm"] == 1
    assert "pass explode failed (RuntimeError: boom); skipped it" in caplog.text


def test_failing_pass_raises_with_fallback_error(exploding_pass):
    compiled = _compile(Norm(), {"target": "eager", "pipeline": ["explode"], "fallback": "error"})
    with pytest.raises(Exception, match="graphopt pass explode failed: RuntimeError: boom"):
        compiled(torch.randn(3, 8))


def test_failing_target_falls_back_to_eager(monkeypatch, caplog):
    monkeypatch.setitem(targets.ENTRIES, "tensorrt", dataclasses.replace(targets.ENTRIES["tensorrt"], where="tests.core.test_fallback:broken"))
    x = torch.randn(3, 8)
    out = _compile(Norm(), {"target": "tensorrt"})(x)
    assert_matches_eager(out, eager(Norm(), x), rel=1e-6)
    (report,) = graphopt.reports()
    assert report.target == "eager"
    assert report.fallbacks == [{"where": "target:tensorrt", "reason": "RuntimeError: cannot lower aten.mm"}]
    assert "running this graph on the eager target" in caplog.text


def test_target_failing_at_run_time_falls_back(monkeypatch):
    monkeypatch.setitem(targets.ENTRIES, "tensorrt", dataclasses.replace(targets.ENTRIES["tensorrt"], where="tests.core.test_fallback:fails_at_run"))
    compiled = _compile(Norm(), {"target": "tensorrt"})
    x = torch.randn(3, 8)
    assert_matches_eager(compiled(x), eager(Norm(), x), rel=1e-6)
    assert_matches_eager(compiled(x), eager(Norm(), x), rel=1e-6)  # stays on eager
    (report,) = graphopt.reports()
    assert report.fallbacks == [{"where": "target:tensorrt (run)", "reason": "RuntimeError: kernel launch failed"}]


def test_a_failed_collective_is_raised_not_rerun_on_eager(monkeypatch):
    # Eager would wait on the same broken process group; the TP launcher names rank and collective.
    where = "tests.core.test_fallback:collective_fails_at_run"
    monkeypatch.setitem(targets.ENTRIES, "tensorrt", dataclasses.replace(targets.ENTRIES["tensorrt"], where=where))
    compiled = _compile(Norm(), {"target": "tensorrt"})
    with pytest.raises(torch.distributed.DistBackendError, match="Connection closed by peer"):
        compiled(torch.randn(3, 8))
    (report,) = graphopt.reports()
    assert report.fallbacks == []


def test_failing_target_raises_with_fallback_error(monkeypatch):
    monkeypatch.setitem(targets.ENTRIES, "tensorrt", dataclasses.replace(targets.ENTRIES["tensorrt"], where="tests.core.test_fallback:broken"))
    compiled = _compile(Norm(), {"target": "tensorrt", "fallback": "error"})
    with pytest.raises(Exception, match="graphopt target:tensorrt failed: RuntimeError: cannot lower aten.mm"):
        compiled(torch.randn(3, 8))
    assert issubclass(BackendFailed, graphopt.GraphoptError)


def test_absent_target_says_why_and_falls_back():
    x = torch.randn(3, 8)
    out = _compile(Norm(), {"target": "tensorrt"})(x)
    assert_matches_eager(out, eager(Norm(), x), rel=1e-6)
    (report,) = graphopt.reports()
    assert report.target == "eager"
    (fallback,) = report.fallbacks
    assert fallback["where"] == "target" and "tensorrt" in fallback["reason"]


def test_graph_the_frontend_cannot_lower_runs_eagerly(monkeypatch):
    import torch._functorch.aot_autograd as aot

    def refuse(*args, **kwargs):
        raise RuntimeError("unsupported op")

    monkeypatch.setattr(aot, "aot_module_simplified", refuse)
    x = torch.randn(3, 8)
    out = _compile(Norm(), {"target": "eager"})(x)
    assert_matches_eager(out, eager(Norm(), x), rel=1e-6)
    (report,) = graphopt.reports()
    assert report.fallbacks == [{"where": "frontend", "reason": "RuntimeError: unsupported op"}]
