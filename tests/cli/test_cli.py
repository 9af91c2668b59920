"""The graphopt command line: documented JSON shapes, help with examples, one-line errors."""

import json

import pytest
from typer.testing import CliRunner

from graphopt.cli.main import app

runner = CliRunner()


def invoke(*args):
    result = runner.invoke(app, list(args))
    return result


def test_passes_json_lists_the_default_pipeline_first():
    result = invoke("passes", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert all(set(r) == {"name", "summary", "default", "requires", "options"} for r in rows)
    defaults = [r["name"] for r in rows if r["default"]]
    from graphopt.pipeline import DEFAULT_PIPELINE

    assert defaults == list(DEFAULT_PIPELINE) and rows[: len(defaults)] == [r for r in rows if r["default"]]
    by_name = {r["name"]: r for r in rows}
    assert by_name["fuse_softmax_rms_norm"]["requires"] == ["fuse_rms_norm"]


def test_passes_lists_each_option_with_type_default_and_help():
    rows = {r["name"]: r for r in json.loads(invoke("passes", "--json").stdout)}
    for row in rows.values():
        assert all(set(o) == {"name", "type", "default", "help"} for o in row["options"]), row
    group_size = next(o for o in rows["quantize_int4"]["options"] if o["name"] == "group_size")
    assert group_size == {"name": "group_size", "type": "int", "default": 32,
                          "help": "weights per scale along K: 32, 64 or 128"}
    assert rows["canonicalize"]["options"] == []
    text = invoke("passes").stdout
    assert "pass options" in text and "group_size" in text and "weights per scale along K" in text


def test_run_json_has_errors_timings_and_reports():
    result = invoke("run", "llama-tiny", "--target", "eager", "--repeat", "2", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["rel_err"] < 1e-5 and data["max_abs_err"] < 1e-4
    assert data["eager_ms"] > 0 and data["graphopt_ms"] > 0 and data["compile_s"] > 0
    assert data["reports"] and {"backend", "target", "passes", "op_counts", "fallbacks"} <= set(data["reports"][0])


def test_run_prints_a_table():
    result = invoke("run", "bert-tiny", "--target", "eager", "--repeat", "1")
    assert result.exit_code == 0, result.output
    for column in ("target", "max abs error", "relative error", "eager ms", "graphopt ms", "compile s"):
        assert column in result.stdout


def test_debug_why_explains_near_misses():
    """A model with one good RMSNorm and one over the wrong axis: one rewrite, one near miss
    with its reason, and numerics within tolerance after the pass."""
    result = invoke("debug", "tests.cli.planted:make_planted", "--pipeline", "fuse_rms_norm", "--why", "fuse_rms_norm",
                    "--timing", "--check-numerics", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    (graph,) = data["graphs"]
    (record,) = graph["passes"]
    assert record["name"] == "fuse_rms_norm" and record["matches"] == 1 and record["near_misses"] == 1
    assert record["numerics"]["ok"] and graph["first_bad_pass"] is None
    (miss,) = [m for m in graph["near_misses"] if not m["screened"]]
    assert (miss["pass_name"], miss["reason"]) == ("fuse_rms_norm", "mean over dim 1, expected -1")


COMMANDS = [c.name for c in app.registered_commands] + [g.name for g in app.registered_groups]


def test_the_command_list_is_the_apps():
    assert {"passes", "run", "debug", "export", "fuzz", "kernels", "models", "options"} <= set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_an_example_and_json(command):
    result = invoke(command, "--help")
    assert result.exit_code == 0
    assert "Example" in result.stdout and "--json" in result.stdout


@pytest.mark.parametrize("args, message", [
    (("run", "no-such-model"), "unknown model 'no-such-model'"),
    (("run", "llama-tiny", "-o", "tagret=eager"), "unknown graphopt option 'tagret'"),
    (("run", "llama-tiny", "-o", "target"), "--option expects key=value"),
    (("debug", "llama-tiny", "--why", "fuse_magic"), "unknown pass 'fuse_magic'"),
])
def test_bad_input_gets_one_error_line(args, message, capsys, monkeypatch):
    from graphopt.cli import main

    monkeypatch.setattr("sys.argv", ["graphopt", *args])
    with pytest.raises(SystemExit) as exit_info:
        main.main()
    assert exit_info.value.code == 2
    err_lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err_lines) == 1 and message in err_lines[0], err_lines


def test_bad_input_message_is_one_line(capfd):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "graphopt.cli.main", "run", "llama-tiny", "-o", "target=tpu"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if l.strip() and "Warning" not in l and "warn(" not in l]
    assert lines[-1].startswith("error: graphopt option target='tpu' is not valid; choose one of:")
    assert "Traceback" not in proc.stderr
