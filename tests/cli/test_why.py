"""graphopt debug --why: a planted near miss is explained, with the node and the reason."""

import json

import pytest

from typer.testing import CliRunner

from graphopt.cli.main import app

PLANTED = "tests.cli.planted:make_planted"


def test_why_names_the_planted_near_miss():
    result = CliRunner().invoke(app, ["debug", PLANTED, "--why", "fuse_rms_norm", "--json"])
    assert result.exit_code == 0, result.output
    (graph,) = json.loads(result.stdout)["graphs"]
    rms = next(p for p in graph["passes"] if p["name"] == "fuse_rms_norm")
    assert rms["matches"] == 1  # the good norm fused
    (miss,) = [m for m in graph["near_misses"] if m["pass_name"] == "fuse_rms_norm" and not m["screened"]]
    assert miss["reason"] == "mean over dim 1, expected -1"
    assert miss["node"].startswith("mean") and miss["anchor"].startswith("rsqrt")


def test_why_prints_a_readable_table():
    result = CliRunner().invoke(app, ["debug", PLANTED, "--why", "fuse_rms_norm"])
    assert result.exit_code == 0, result.output
    assert "fuse_rms_norm: 1 rewrites, 1 near misses" in result.stdout
    assert "mean over dim 1, expected -1" in result.stdout


def test_why_on_a_pass_outside_the_pipeline_says_so():
    args = ["debug", PLANTED, "--pipeline", "canonicalize,fuse_rms_norm", "--why", "fuse-rope"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert ("fuse_rope: not in the pipeline (canonicalize, fuse_rms_norm), so it looked at nothing; "
            "add it with --pipeline") in result.stdout
    assert "fuse_rope: 0 rewrites" not in result.stdout
    data = json.loads(CliRunner().invoke(app, [*args, "--why", "fuse_rms_norm", "--json"]).stdout)
    assert data["why_not_in_pipeline"] == ["fuse_rope"]


def test_why_on_a_disabled_pass_says_so():
    result = CliRunner().invoke(app, ["debug", PLANTED, "--pipeline", "canonicalize,fuse_rms_norm",
                                      "--disable-pass", "fuse_rms_norm", "--why", "fuse_rms_norm"])
    assert result.exit_code == 0, result.output
    assert "fuse_rms_norm: disabled (--disable-pass), so it looked at nothing" in result.stdout


def test_target_onnxruntime_lists_the_onnx_passes_after_graphopts():
    pytest.importorskip("onnxruntime")
    result = CliRunner().invoke(app, ["debug", "llama-tiny", "--target", "onnxruntime", "--json",
                                      "--why", "onnx:tidy_attention_layout"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    (graph,) = out["graphs"]
    names = [p["name"] for p in graph["passes"]]
    first = next(i for i, name in enumerate(names) if name.startswith("onnx:"))
    assert "fuse_attention" in names[:first] and all(name.startswith("onnx:") for name in names[first:])
    assert any(p["name"] == "onnx:light_cleanup" and p["matches"] > 0 for p in graph["passes"])
    assert out["why_not_in_pipeline"] == []  # the onnx pass asked about ran
    assert graph["lowering"] == "lowered with ONNX Runtime's exporter"


def test_target_without_an_exporter_is_one_error():
    result = CliRunner().invoke(app, ["debug", "llama-tiny", "--target", "eager"])
    assert result.exit_code != 0
    assert "lends no exporter" in str(result.exception) + result.output
