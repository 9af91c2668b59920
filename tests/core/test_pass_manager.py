"""PassManager instrumentation: disable, bisect limit, print IR, numeric checks, preconditions."""

import io
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from graphopt.config import Options
from graphopt.errors import OptionsError
from graphopt.instrument import NumericCheck, PrintIR
from graphopt.pass_manager import NoOptions, PassContext, PassManager
from graphopt.registry import get_pass
from tests.debug.planted import Explode
from tests.helpers import aten_graph


class TwoNorms(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16))

    def forward(self, x):
        a = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
        return a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6)


def _graph():
    x = torch.randn(2, 16)
    return aten_graph(TwoNorms(), x), [x]


def _run(passes, config=None, instruments=(), inputs=None, **kwargs):
    gm, example = _graph()
    config = config or Options()
    manager = PassManager([get_pass(p) for p in passes], instruments, **kwargs)
    return manager.run(gm, PassContext(config, inputs or example))


def test_records_each_pass_in_order():
    result = _run(["canonicalize", "fuse_rms_norm"])
    assert [r.name for r in result.records] == ["canonicalize", "fuse_rms_norm"]
    rms = result.records[1]
    assert rms.status == "changed" and rms.matches == 2 and rms.nodes_after < rms.nodes_before
    assert [r.pass_name for r in result.rewrites] == ["fuse_rms_norm", "fuse_rms_norm"]


def test_disabled_pass_does_not_run():
    result = _run(["fuse_rms_norm"], disabled=["fuse_rms_norm"])
    assert result.records[0].status == "disabled"
    assert not any(n.target == torch.ops.graphopt.rms_norm.default for n in result.gm.graph.nodes)


def test_bisect_limit_stops_after_n_rewrites():
    result = _run(["fuse_rms_norm"], config=Options(bisect_limit=1))
    assert result.records[0].matches == 1
    assert [m.reason for m in result.near_misses if not m.screened] == ["bisect limit reached"]
    assert len(result.rewrites) == 1


def test_print_ir_after_change_and_diff():
    stream = io.StringIO()
    printer = PrintIR(after_change=True, diff=True, stream=stream)
    _run(["canonicalize", "fuse_rms_norm"], instruments=[printer])
    text = stream.getvalue()
    assert "IR diff fuse_rms_norm" in text and "IR diff canonicalize" not in text  # unchanged: not printed
    assert "+%rms_norm" in text and "graphopt.rms_norm" in text and "<- fuse_rms_norm" in text
    assert "-%rsqrt" in text


def test_print_ir_before_shows_shapes():
    printer = PrintIR(before=["fuse_rms_norm"])
    _run(["fuse_rms_norm"], instruments=[printer])
    (chunk,) = printer.chunks
    assert chunk["when"] == "before" and "f32[2, 16]" in chunk["text"]


@dataclass
class ChangesEps:
    """A wrong pass: rewrites every rms_norm's eps to 1.0 (a planted numeric bug)."""

    name: str = "fuse_rms_norm"  # pretends to be a real pass
    summary: str = "wrong on purpose"
    Options: type = NoOptions
    requires: tuple = ()

    def run(self, gm, ctx):
        from graphopt.pass_manager import PassResult

        result = get_pass("fuse_rms_norm").run(gm, ctx)
        for node in result.gm.graph.nodes:
            if node.target == torch.ops.graphopt.rms_norm.default:
                node.args = (node.args[0], node.args[1], 1.0, node.args[3])
        result.gm.recompile()
        return result


def test_numeric_check_flags_the_first_bad_pass():
    gm, inputs = _graph()
    checker = NumericCheck(inputs, tolerance=1e-5)
    manager = PassManager([get_pass("canonicalize"), ChangesEps()], [checker])
    result = manager.run(gm, PassContext(Options(), inputs))
    assert checker.first_bad == "fuse_rms_norm"
    assert result.records[1].numerics["ok"] is False and result.records[1].numerics["rel_err"] > 1e-3


@dataclass
class AddsZero:
    """A correct pass that changes the graph: adds 0 to the output (no numeric change)."""

    name: str = "adds_zero"
    summary: str = "x + 0 at the output (tests)"
    Options: type = NoOptions
    requires: tuple = ()

    def run(self, gm, ctx):
        from graphopt.pass_manager import PassResult

        output = gm.graph.output_node()
        values = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
        with gm.graph.inserting_before(output):
            values[0] = gm.graph.call_function(torch.ops.aten.add.Tensor, (values[0], 0.0))
        values[0].meta["val"] = values[0].args[0].meta["val"]
        output.args = (tuple(values),) if isinstance(output.args[0], (tuple, list)) else (values[0],)
        gm.recompile()
        return PassResult(gm, modified=True, stats={"matches": 1})


def test_numeric_check_blames_the_pass_that_made_the_error_not_the_ones_after():
    """Each pass is compared with the previous pass's output: a correct pass after the bad
    one is ok, though its output is still as far from the input as the bad pass left it."""
    gm, inputs = _graph()
    checker = NumericCheck(inputs, tolerance=1e-5)
    result = PassManager([ChangesEps(), AddsZero()], [checker]).run(gm, PassContext(Options(), inputs))
    bad, after = (r.numerics for r in result.records)
    assert checker.first_bad == checker.first_drift == "fuse_rms_norm"
    assert bad["ok"] is False and bad["rel_err"] == bad["rel_err_vs_input"] > 1e-3
    assert after["ok"] is True and after["rel_err"] == 0 and after["rel_err_vs_input"] == bad["rel_err_vs_input"]


def test_numeric_check_passes_a_correct_pipeline():
    gm, inputs = _graph()
    checker = NumericCheck(inputs, tolerance=1e-5)
    result = PassManager([get_pass("fuse_rms_norm")], [checker]).run(gm, PassContext(Options(), inputs))
    assert checker.first_bad is None and result.records[0].numerics["ok"] is True


def test_requires_is_checked_when_the_pipeline_is_built():
    @dataclass
    class NeedsRms:
        name: str = "after_rms"
        summary: str = "needs fuse_rms_norm"
        Options: type = NoOptions
        requires: tuple = ("fuse_rms_norm",)

        def run(self, gm, ctx):
            raise AssertionError("never runs")

    with pytest.raises(OptionsError, match="pass after_rms needs fuse_rms_norm to run before it"):
        PassManager([NeedsRms(), get_pass("fuse_rms_norm")])
    PassManager([get_pass("fuse_rms_norm"), NeedsRms()])  # right order: fine


def test_a_pass_that_breaks_metadata_is_rejected_by_verify():
    @dataclass
    class DropsMeta:
        name: str = "drops_meta"
        summary: str = "forgets meta['val']"
        Options: type = NoOptions
        requires: tuple = ()

        def run(self, gm, ctx):
            from graphopt.pass_manager import PassResult

            node = next(n for n in gm.graph.nodes if n.op == "call_function")
            del node.meta["val"]
            return PassResult(gm, modified=True, stats={"matches": 1})

    gm, inputs = _graph()
    result = PassManager([DropsMeta()]).run(gm, PassContext(Options(), inputs))
    assert result.records[0].status == "failed" and "has no meta['val']" in result.records[0].error
    assert all("val" in n.meta for n in result.gm.graph.nodes if n.op != "output")  # old graph kept


def _node_targets(gm):
    return [str(n.target) for n in gm.graph.nodes]


@pytest.mark.parametrize("instrumented", [False, True])
def test_a_pass_that_fails_half_way_is_skipped_and_its_edits_are_gone(instrumented, caplog):
    """Uninstrumented passes share one copy, so the failure is found there and the pipeline
    runs again with a copy per pass: the result, records and rewrites are those of one run."""
    gm, inputs = _graph()
    before = _node_targets(gm)
    instruments = [PrintIR()] if instrumented else []
    manager = PassManager([get_pass("fuse_rms_norm"), Explode(), AddsZero()], instruments)
    with caplog.at_level("WARNING", logger="graphopt"):
        result = manager.run(gm, PassContext(Options(), inputs))
    assert [r.status for r in result.records] == ["changed", "failed", "changed"]
    assert "boom: planted failure" in result.records[1].error
    assert [f["where"] for f in result.fallbacks] == ["pass:explode"]
    assert [r.index for r in result.rewrites] == [1, 2]  # fuse_rms_norm's two, counted once
    targets = _node_targets(result.gm)  # Explode emptied its first op's arguments: that edit is gone
    assert all(n.args for n in result.gm.graph.nodes if n.op == "call_function")
    assert targets.count("graphopt.rms_norm.default") == 2
    assert "aten.add.Tensor" in targets  # the pass after the failure ran
    assert _node_targets(gm) == before  # the caller's graph is untouched
    assert sum("explode failed" in r.message for r in caplog.records) == 1
    x = inputs[0]
    torch.testing.assert_close(result.gm(x)[0], gm(x)[0], rtol=1e-5, atol=1e-5)


def test_uninstrumented_passes_share_one_copy_of_the_graph(monkeypatch):
    from graphopt import ir

    copies = []
    real = ir.copy_graph_module
    monkeypatch.setattr(ir, "copy_graph_module", lambda gm: copies.append(gm) or real(gm))
    gm, inputs = _graph()
    before = _node_targets(gm)
    result = PassManager([get_pass(p) for p in ("canonicalize", "fuse_rms_norm")]).run(gm, PassContext(Options(), inputs))
    assert len(copies) == 1 and result.records[1].status == "changed"
    assert _node_targets(gm) == before
    copies.clear()
    PassManager([get_pass(p) for p in ("canonicalize", "fuse_rms_norm")], [PrintIR()]).run(*_graph()[:1], PassContext(Options(), inputs))
    assert len(copies) == 2  # instrumented: one a pass, as PrintIR's diffs need the graph before
