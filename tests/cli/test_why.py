"""graphopt debug --why: a planted near miss is explained, with the node and the reason."""

import json

from typer.testing import CliRunner

from graphopt.cli.main import app

PLANTED = "tests.cli.planted:make_planted"


def test_why_names_the_planted_near_miss():
    result = CliRunner().invoke(app, ["debug", PLANTED, "--why", "fuse_rms_norm", "--json"])
    assert result.exit_code == 0, result.output
    (graph,) = json.loads(result.stdout)["graphs"]
    rms = next(p for p in graph["passes"] if p["name"] == "fuse_rms_norm")
    assert rms["matches"] == 1  # the good norm fused
    (miss,) = [m for m in graph["near_misses"] if m["pass_name"] == "fuse_rms_norm"]
    assert miss["reason"] == "mean over dim 1, expected -1"
    assert miss["node"].startswith("mean") and miss["anchor"].startswith("rsqrt")


def test_why_prints_a_readable_table():
    result = CliRunner().invoke(app, ["debug", PLANTED, "--why", "fuse_rms_norm"])
    assert result.exit_code == 0, result.output
    assert "fuse_rms_norm: 1 rewrites, 1 near misses" in result.stdout
    assert "mean over dim 1, expected -1" in result.stdout
