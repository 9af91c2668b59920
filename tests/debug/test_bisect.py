"""``graphopt debug --bisect``: the first pass, then the first rewrite, past the tolerance."""

import re
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from graphopt.registry import get_pass, scoped_passes
from graphopt.config import Options
from graphopt.debug.bisect import bisect_rewrites
from graphopt.pass_manager import NoOptions
from graphopt.pipeline import DEFAULT_PIPELINE
from tests.debug.conftest import RMS_PIPELINE, debug, debug_json, rerun
from tests.helpers import aten_graph


def test_bisect_names_the_planted_pass_and_the_exact_rewrite(planted):
    data = debug_json("llama-tiny", "--pipeline", RMS_PIPELINE + ",rewrite_eps", "--bisect", "--tolerance", "1e-4")
    b = data["bisect"]
    wrong = planted["rewrite_eps"].wrong_anchor
    (graph,) = data["graphs"]
    ours = [r for r in graph["rewrites"] if r["pass_name"] == "rewrite_eps"]
    # the third rewrite_eps rewrite (wrong=2) is the bad one; fuse_rms_norm's five come first
    assert len(ours) == 5 and ours[2]["node"] == wrong
    assert (b["pass"], b["rewrite_index"], b["node"], b["target"]) == ("rewrite_eps", ours[2]["index"], wrong,
                                                                       "graphopt.rms_norm")
    assert b["rewrite_index"] > 5  # fuse_rms_norm's rewrites were passed over
    assert b["rel_err_before"] <= 1e-4 < b["rel_err"]
    assert b["graph"] == 0 and b["runs"] <= 3 + 2 * 4  # full, limit 0, a check at K, O(log N) probes
    assert f"-%{wrong} = graphopt.rms_norm" in b["diff"] and ", 1, 0)" in b["diff"]  # eps 1.0 on the new node
    # The printed command reproduces it: past the tolerance at K, within it at K - 1.
    assert rerun(b["command"])["graphs"][0]["first_bad_pass"] == "rewrite_eps"
    assert rerun(b["good_command"])["graphs"][0]["first_bad_pass"] is None


def test_bisect_prints_pass_rewrite_node_and_command(planted):
    out = debug("llama-tiny", "--pipeline", RMS_PIPELINE + ",rewrite_eps", "--bisect").stdout
    wrong = planted["rewrite_eps"].wrong_anchor
    assert "first bad pass: rewrite_eps" in out
    found = re.search(rf"first bad rewrite: #(\d+) \(rewrite_eps at node {wrong}, graphopt.rms_norm\)", out)
    assert found, out
    assert (f"reproduce: graphopt debug llama-tiny --pipeline {RMS_PIPELINE},rewrite_eps "
            f"--bisect-limit {found.group(1)} --check-numerics --tolerance 0.0001") in out


def test_bisect_within_tolerance_says_so_and_is_null_in_json():
    data = debug_json("llama-tiny", "--pipeline", RMS_PIPELINE, "--bisect")
    assert data["bisect"] is None and "within tolerance" in data["bisect_summary"]
    assert data["graphs"][0]["bisect"]["full_rel_err"] <= 1e-4
    assert "bisect: output within tolerance" in debug("llama-tiny", "--pipeline", RMS_PIPELINE, "--bisect").stdout


def test_bisect_and_a_manual_limit_exclude_each_other(capsys, monkeypatch):
    from graphopt.cli import main

    monkeypatch.setattr("sys.argv", ["graphopt", "debug", "llama-tiny", "--bisect", "--bisect-limit", "3"])
    with pytest.raises(SystemExit) as exit_info:
        main.main()
    assert exit_info.value.code == 2
    assert "drop --bisect-limit" in capsys.readouterr().err


class TwoNorms(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16))

    def forward(self, x):
        a = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
        return a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6)


def _sneaky(name: str, change):
    """A pass that applies ``change(node)`` to every node, never asking allow_rewrite."""

    @dataclass
    class Sneaky:
        summary: str = "uncounted numeric change (tests)"
        Options: type = NoOptions
        requires: tuple = ()

        def run(self, gm, ctx):
            from graphopt.pass_manager import PassResult

            changed = [node for node in gm.graph.nodes if change(node)]
            gm.recompile()
            return PassResult(gm, modified=bool(changed), stats={"matches": 0})

    p = Sneaky()
    p.name = name
    return p


def _eps_of_rms_norm_to_one(node) -> bool:
    if node.target is not torch.ops.graphopt.rms_norm.default:
        return False
    node.args = (node.args[0], node.args[1], 1.0, *node.args[3:])
    return True


def _eps_of_add_to_one(node) -> bool:
    if node.target is not torch.ops.aten.add.Tensor or node.args[1] != 1e-6:
        return False
    node.args = (node.args[0], 1.0)
    return True


def _bisect_two_norms(pipeline):
    x = torch.randn(4, 16)
    return bisect_rewrites(aten_graph(TwoNorms(), x), [x], Options.parse({"pipeline": pipeline}), 1e-4)


def test_uncounted_change_before_any_rewrite_names_the_pass_without_an_index():
    with scoped_passes(_sneaky("sneaky_add", _eps_of_add_to_one)):
        outcome = _bisect_two_norms(["sneaky_add", "fuse_rms_norm"])
    found = outcome.found
    assert found.pass_name == "sneaky_add" and found.rewrite_index is None and found.node is None
    assert "allow_rewrite" in found.note and "1e-06)" in found.diff and ", 1)" in found.diff


def test_uncounted_change_on_a_rewritten_node_names_that_pass_and_the_rewrite():
    with scoped_passes(_sneaky("sneaky_eps", _eps_of_rms_norm_to_one)):
        outcome = _bisect_two_norms(["fuse_rms_norm", "sneaky_eps"])
    found = outcome.found
    # The second norm rescales away what eps does to the first, so rewrite 1 is harmless even
    # with eps 1.0 and the error appears with rewrite 2, in sneaky_eps's output.
    assert (found.pass_name, found.rewrite_index, found.rewrite_pass, found.node) == (
        "sneaky_eps", 2, "fuse_rms_norm", "rsqrt_1")
    assert "sneaky_eps" in found.note and found.rel_err_before <= 1e-4 < found.rel_err


def test_bisect_on_a_small_graph_finds_the_second_rewrite():
    from tests.debug.planted import RewriteEps

    bad = RewriteEps(wrong=1)
    x = torch.randn(4, 16)
    gm = aten_graph(TwoNorms(), x)
    with scoped_passes(bad):
        outcome = bisect_rewrites(gm, [x], Options.parse({"pipeline": ["fuse_rms_norm", "rewrite_eps"]}), 1e-4)
    assert outcome.found.rewrite_pass == "rewrite_eps" and outcome.found.note is None
    # rewrites: 1, 2 = fuse_rms_norm; 3, 4 = rewrite_eps (the second of them wrong)
    assert (outcome.found.pass_name, outcome.found.rewrite_index, outcome.found.node) == ("rewrite_eps", 4, bad.wrong_anchor)
    assert [p["limit"] for p in outcome.probes][:2] == [-1, 0]


def test_int4_pass_is_named_with_its_first_rewrite():
    get_pass("quantize_int4")  # registered: a missing pass must fail here, not skip
    pipeline = ",".join([*DEFAULT_PIPELINE, "quantize_int4"])
    data = debug_json("llama-tiny", "--pipeline", pipeline, "--bisect", "--tolerance", "1e-4")
    b = data["bisect"]
    first = min(r["index"] for r in data["graphs"][0]["rewrites"] if r["pass_name"] == "quantize_int4")
    assert b["pass"] == "quantize_int4" and b["rewrite_index"] == first
    assert b["rel_err"] > 1e-4 >= b["rel_err_before"]
