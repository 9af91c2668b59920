"""``graphopt export`` options: --opset is honoured or refused in one line, --option int4=true
is --int4, and an export that fails validation leaves no file behind."""

from __future__ import annotations

import json
import os

import onnx
import pytest
from typer.testing import CliRunner

from graphopt.cli.export_cmd import DEFAULT_OPSET, MIN_OPSET
from graphopt.cli.main import app
from tests.backends.onnxruntime._helpers import rel_err  # noqa: F401  (skips without onnxruntime)

runner = CliRunner()


def export(*args: str):
    return runner.invoke(app, ["export", "llama-tiny", *args, "--json"])


def opset_of(path) -> int:
    model = onnx.load(str(path), load_external_data=False)
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


@pytest.mark.parametrize("opset", [MIN_OPSET - 1, onnx.defs.onnx_opset_version() + 1])
def test_an_opset_the_exporter_would_not_honour_is_one_error_line(opset, tmp_path, capsys, monkeypatch):
    from graphopt.cli import main

    monkeypatch.setattr("sys.argv", ["graphopt", "export", "llama-tiny", "-o", str(tmp_path / "m.onnx"),
                                     "--opset", str(opset)])
    with pytest.raises(SystemExit) as exit_info:
        main.main()
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: --opset {opset} is not supported: choose {MIN_OPSET} to "
                      f"{onnx.defs.onnx_opset_version()} (the exporter writes opset {MIN_OPSET} or newer; "
                      f"onnx {onnx.__version__} knows up to {onnx.defs.onnx_opset_version()})"]
    assert os.listdir(tmp_path) == []


def test_the_file_has_the_opset_asked_for_and_the_help_names_the_default(tmp_path):
    path = tmp_path / "m.onnx"
    result = export("-o", str(path), "--opset", "19", "--no-validate")
    assert result.exit_code == 0, result.output
    assert opset_of(path) == 19
    assert opset_of(json.loads(result.stdout)["files"][0]["path"]) == 19
    assert f"[default: {DEFAULT_OPSET}]" in runner.invoke(app, ["export", "--help"], terminal_width=200).stdout


def test_option_int4_is_validated_like_the_int4_flag(tmp_path):
    """INT4 logits differ from eager by design: shown, not judged at the fp32 tolerance."""
    path = tmp_path / "q.onnx"
    result = export("-o", str(path), "--option", "int4=true")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    (model,) = data["files"]
    assert data["ok"] and model["int4"]["matmulnbits"] > 0
    assert "quantize_int4" in [p["name"] for p in data["passes"]]
    assert all(row["rel_err"] > 1e-4 for row in model["validation"])  # past the fp32 tolerance, still ok
    assert os.listdir(tmp_path) == ["q.onnx"] and opset_of(path) == DEFAULT_OPSET  # no --opset: the default


def test_a_failed_validation_leaves_no_file_and_keeps_the_old_one(tmp_path):
    path = tmp_path / "m.onnx"
    path.write_bytes(b"an earlier export")
    result = export("-o", str(path), "--force", "--option", "tolerance=1e-12")
    assert result.exit_code == 1, result.output
    data = json.loads(result.stdout)
    assert not data["ok"] and not data["written"] and data["files"][0]["path"] == str(path)
    # not replaced: the new file never left the staging folder, which is gone too
    assert os.listdir(tmp_path) == ["m.onnx"] and path.read_bytes() == b"an earlier export"
