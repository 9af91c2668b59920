"""``graphopt debug --reproducer DIR`` and ``--replay DIR``: a failing pass's input graph,
written without pickle, reruns the failure with one command."""

import json
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.fx as fx
from torch import nn

from graphopt import ir
from graphopt.registry import scoped_passes
from graphopt.debug.graph_source import SourceError, graph_to_source, load_graph
from graphopt.debug.reproducer import load_reproducer, write_reproducer
from graphopt.pass_manager import NoOptions, PassResult
from tests.debug.conftest import RMS_PIPELINE, debug, debug_json
from tests.helpers import aten_graph

FILES = {"graph.py", "constants.safetensors", "inputs.safetensors", "manifest.json", "replay.py"}


@pytest.fixture
def explode_repro(planted, tmp_path):
    """llama-tiny through canonicalize, fuse_rms_norm and a pass that raises."""
    repro = tmp_path / "repro"
    data = debug_json("llama-tiny", "--pipeline", RMS_PIPELINE + ",explode", "--reproducer", str(repro),
                      "--print-ir-after", "fuse_rms_norm")
    return repro, data


def test_reproducer_holds_the_failing_pass_input_graph_without_pickle(explode_repro):
    repro, data = explode_repro
    assert data["reproducer"] == {"dir": str(repro), "pass": "explode", "error": "RuntimeError: boom: planted failure",
                                  "command": f"graphopt debug --replay {repro}"}
    assert {p.name for p in repro.iterdir()} == FILES
    manifest = json.loads((repro / "manifest.json").read_text())
    assert manifest["pipeline"] == RMS_PIPELINE + ",explode" and manifest["pass"] == "explode"
    assert manifest["origin"]["command"].endswith("--print-ir-after-failure")
    assert {"graphopt", "torch", "python"} <= set(manifest["versions"])
    loaded = load_reproducer(repro)
    (after_rms,) = [c["text"] for c in data["ir"] if c["pass"] == "fuse_rms_norm"]
    assert ir.format_graph(loaded.gm) == after_rms  # explode's input, node for node, with shapes
    ir.verify_graph(loaded.gm)


def test_replay_reruns_the_failure_and_exits_1(explode_repro):
    repro, _ = explode_repro
    result = debug("--replay", str(repro), expect_code=1)
    assert "// ----- IR after failure of explode -----" in result.stdout
    assert "reproduced: pass explode failed: RuntimeError: boom: planted failure" in result.stdout
    data = debug_json("--replay", str(repro), expect_code=1)
    assert data["replay"]["reproduced"] is True and data["replay"]["status"] == "failed"


def test_replay_after_the_fix_exits_0(explode_repro, monkeypatch):
    repro, _ = explode_repro

    @dataclass
    class Fixed:
        name: str = "explode"
        summary: str = "fixed"
        Options: type = NoOptions
        requires: tuple = ()

        def run(self, gm, ctx):
            return PassResult(gm, modified=False, stats={"matches": 0})

    with scoped_passes(Fixed()):
        result = debug("--replay", str(repro))
    assert "not reproduced: pass explode now unchanged" in result.stdout


def test_a_verification_failure_is_reproduced_too(planted, tmp_path):
    repro = tmp_path / "repro"
    data = debug_json("llama-tiny", "--pipeline", RMS_PIPELINE + ",drops_val,explode", "--reproducer", str(repro))
    assert data["reproducer"]["pass"] == "drops_val"  # the first failure; explode's is not written over it
    replayed = debug_json("--replay", str(repro), expect_code=1)["replay"]
    assert replayed["error"] == "ValueError: node rms_norm_default (graphopt.rms_norm) has no meta['val']"


def test_no_failure_writes_nothing(tmp_path):
    data = debug_json("llama-tiny", "--pipeline", RMS_PIPELINE, "--reproducer", str(tmp_path / "repro"))
    assert data["reproducer"] is None and not (tmp_path / "repro").exists()


class Literals(nn.Module):
    """Ops whose arguments are slices, dtypes, devices, infinities and lists."""

    def forward(self, x):
        y = x[..., 1:3].to(torch.float16).float()
        z = torch.full((2, 2), float("-inf"), device=x.device).clamp(min=-1e4)
        return torch.cat([y, z[:1].expand(x.shape[0], 2)], dim=-1).softmax(-1)


def test_graph_source_round_trips_literal_arguments_and_runs_standalone(tmp_path):
    x = torch.randn(3, 4)
    gm = aten_graph(Literals(), x)
    source = graph_to_source(gm)
    rebuilt = load_graph(source, {}, [x])
    assert ir.format_graph(rebuilt) == ir.format_graph(gm)
    torch.testing.assert_close(rebuilt(x), gm(x), rtol=0, atol=0)
    # The reproducer runner works in a fresh process, from the written files alone.
    repro = write_reproducer(tmp_path / "r", gm, None, pass_name="canonicalize", error="RuntimeError: was broken",
                             pipeline="canonicalize")
    assert load_reproducer(repro).inputs[0].shape == (3, 4)  # synthesized from meta["val"]
    proc = subprocess.run([sys.executable, str(repro / "replay.py")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "not reproduced: pass canonicalize now" in proc.stdout


def test_graph_source_refuses_what_it_cannot_spell():
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.aten.add.Tensor, (x, torch.ones(1))))
    with pytest.raises(SourceError, match="cannot write argument tensor"):
        graph_to_source(fx.GraphModule({}, graph))


def test_replay_of_a_directory_that_is_not_a_reproducer_is_one_error_line(tmp_path, capsys, monkeypatch):
    from graphopt.cli import main

    monkeypatch.setattr("sys.argv", ["graphopt", "debug", "--replay", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_info:
        main.main()
    assert exit_info.value.code == 2
    assert "is not a graphopt reproducer (no manifest.json)" in capsys.readouterr().err
