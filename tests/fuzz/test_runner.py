"""The differential runner: tolerances by dtype, targets that cannot run here are skipped
with a reason, and a planted miscompilation is caught, shrunk and written as a reproducer
that reruns (failing while the bug is there, passing once it is fixed)."""

import dataclasses
import json
import runpy

import pytest
import torch
from typer.testing import CliRunner

from graphopt import targets
from graphopt.registry import scoped_passes
from graphopt.cli.main import app
from graphopt.fuzz.check import Reference, judge
from graphopt.fuzz.generate import Settings
from graphopt.fuzz.runner import fuzz_pipeline, resolve_targets, run_fuzz
from tests.fuzz.planted_bugs import DropWeightOffset, Fixed


def ref(eager, float64=None):
    return Reference((eager,), (float64 if float64 is not None else eager.double(),))


@pytest.mark.parametrize("dtype, noise, status", [
    ("float32", 1e-6, "ok"), ("float32", 1e-3, "mismatch"),
    ("float16", 3e-3, "ok"), ("float16", 5e-2, "mismatch"),
    ("bfloat16", 2e-2, "ok"), ("bfloat16", 2e-1, "mismatch"),
])
def test_tolerance_depends_on_the_dtype(dtype, noise, status):
    torch.manual_seed(0)
    eager = torch.randn(64, dtype=torch.float64)
    got = eager + noise * eager.norm() / 8 * torch.randn(64, dtype=torch.float64)
    assert judge((got.float(),), ref(eager.float()), dtype)[0] == status


def test_error_past_tolerance_is_accepted_when_graphopt_is_as_close_to_float64_as_eager():
    exact = torch.randn(64, dtype=torch.float64)
    eager = exact + 0.05 * torch.randn(64, dtype=torch.float64)  # eager itself is far off
    got = exact + 0.05 * torch.randn(64, dtype=torch.float64)
    assert judge((got.half(),), Reference((eager.half(),), (exact,)), "float16")[0] == "ok"
    worse = exact + 0.5 * torch.randn(64, dtype=torch.float64)
    assert judge((worse.half(),), Reference((eager.half(),), (exact,)), "float16")[0] == "mismatch"


def test_wrong_shape_dtype_or_count_is_a_mismatch():
    eager = torch.randn(4, 8)
    assert judge((eager.T.contiguous(),), ref(eager), "float32")[0] == "mismatch"
    assert judge((eager.half(),), ref(eager), "float32")[0] == "mismatch"
    assert judge((eager, eager), ref(eager), "float32")[0] == "mismatch"


def test_targets_that_cannot_run_here_are_skipped_with_a_reason(monkeypatch):
    monkeypatch.setitem(targets.ENTRIES, "triton", dataclasses.replace(targets.ENTRIES["triton"], where="graphopt.backends.no_such_module:triton"))
    usable, skipped = resolve_targets(["eager", "triton", "tensorrt"])
    assert usable == ["eager"]
    assert "triton" in skipped["triton"] and "tensorrt" in skipped["tensorrt"]


@pytest.fixture
def planted_bug():
    """drop_weight_offset in the registry, right after fuse_rms_norm in the pipeline."""
    with scoped_passes(DropWeightOffset()):
        pipeline = fuzz_pipeline()
        pipeline.insert(pipeline.index("fuse_rms_norm") + 1, "drop_weight_offset")
        yield pipeline


def test_planted_miscompilation_is_caught_shrunk_and_reproduced(planted_bug, monkeypatch, tmp_path):
    settings = Settings(min_steps=3, max_steps=5, plant_percent=70,
                        only=("plant_rms_norm", "plant_add_rms_norm", "linear", "silu", "add"))
    summary = run_fuzz(3, seed=5, targets=["eager"], out_dir=tmp_path, settings=settings,
                       pipeline=planted_bug, shrink_budget=25)
    assert summary.mismatches >= 1 and summary.crashes == 0
    failure = summary.failures[0]
    assert failure.status == "mismatch" and "relative error" in failure.detail
    assert failure.steps_after < failure.steps_before and "gemma" in (tmp_path / failure.reproducer / "model.py").read_text()
    folder = tmp_path / failure.reproducer
    assert {p.name for p in folder.iterdir()} == {"model.py", "inputs.safetensors", "inputs_1.safetensors", "repro.py",
                                                  "case.json", "README.md"}  # inputs_1: the second shape
    assert "python" in (folder / "README.md").read_text() and "repro.py" in (folder / "README.md").read_text()
    with pytest.raises(SystemExit) as exit_info:  # still failing: exit status 1
        runpy.run_path(str(folder / "repro.py"), run_name="__main__")
    assert exit_info.value.code == 1
    with scoped_passes(Fixed()), pytest.raises(SystemExit) as exit_info:  # the bug fixed: the reproducer passes
        runpy.run_path(str(folder / "repro.py"), run_name="__main__")
    assert exit_info.value.code == 0


def test_fuzz_command_json_has_the_documented_keys(tmp_path):
    result = CliRunner().invoke(app, ["fuzz", "--graphs", "3", "--seed", "1", "--target", "eager",
                                      "--out", str(tmp_path / "out"), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["graphs"] == 3 and data["mismatches"] == 0 and data["crashes"] == 0
    assert all(isinstance(data[k], int) for k in ("graphs", "mismatches", "crashes"))
    assert isinstance(data["fallbacks"], list) and isinstance(data["hits"], dict)
    assert set(fuzz_pipeline()) <= set(data["hits"])
    assert not (tmp_path / "out").exists()  # no failure, no reproducer folder


def test_fuzz_command_prints_tables_and_exits_1_on_a_failure(planted_bug, tmp_path, monkeypatch):
    import graphopt.fuzz.runner as runner

    monkeypatch.setattr(runner, "fuzz_pipeline", lambda: planted_bug)
    result = CliRunner().invoke(app, ["fuzz", "--graphs", "2", "--seed", "6", "--target", "eager", "--out", str(tmp_path),
                                      "--shrink-budget", "0", "--only", "plant_rms_norm", "--only", "silu"])
    assert "pattern hits per pass" in result.stdout and "mismatches" in result.stdout
    assert result.exit_code == 1 and "mismatch" in result.stdout and str(tmp_path) in result.stdout


def test_fuzz_command_has_help_with_an_example():
    result = CliRunner().invoke(app, ["fuzz", "--help"])
    assert result.exit_code == 0 and "Example: graphopt fuzz" in result.stdout and "--json" in result.stdout
