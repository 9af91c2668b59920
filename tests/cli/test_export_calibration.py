"""``graphopt export --int4 --calibration-text FILE --int4-budget F``: the text's token ids (by the
model's own tokenizer) and the budget reach quantize_int4's options, the summary says what it
calibrated on, and a bad file or a model without a tokenizer is one error line."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from graphopt.quant import plan as quant_plan
from graphopt.cli.main import app
from tests.backends.onnxruntime._helpers import rel_err  # noqa: F401  (skips without onnxruntime)
from tests.generate import text_model

pytest.importorskip("transformers")
TEXT = "the big red dog runs to the river and then it sleeps on the mat of the cat " * 8
TOKENS = 40  # fewer than the text has: the flag takes the first N


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return text_model.save(tmp_path_factory.mktemp("tiny-text"))


@pytest.fixture(scope="module")
def calibrated(checkpoint, tmp_path_factory):
    """One export of a tiny checkpoint with a tokenizer, with the calls to quant_plan that
    receive the calibration ids and the budget recorded."""
    folder = tmp_path_factory.mktemp("calibration")
    text = folder / "notes.txt"
    text.write_text(TEXT, encoding="utf-8")
    seen = {"ids": [], "budgets": []}
    ids_of, allocate = quant_plan.calibration_inputs, quant_plan.allocate_bits

    def spy_ids(gm, example_inputs, token_ids):
        seen["ids"].append(list(token_ids))
        return ids_of(gm, example_inputs, token_ids)

    def spy_budget(layers, budget):
        seen["budgets"].append(budget)
        return allocate(layers, budget)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quant_plan, "calibration_inputs", spy_ids)
        mp.setattr(quant_plan, "allocate_bits", spy_budget)
        result = CliRunner().invoke(app, ["export", str(checkpoint), "-o", str(folder / "q.onnx"), "--int4",
                                          "--calibration-text", str(text), "--calibration-tokens", str(TOKENS),
                                          "--int4-budget", "0.25", "--no-validate", "--json"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return json.loads(result.stdout), seen


def test_the_texts_first_tokens_reach_the_pass_and_the_json_says_so(calibrated):
    data, seen = calibrated
    expected = text_model.tokenizer()(TEXT)["input_ids"][:TOKENS]
    assert len(expected) == TOKENS and len(set(expected)) > 5  # real words, not padding
    assert seen["ids"] == [expected]
    info = data["int4_calibration"]
    assert info["source"]["tokens"] == TOKENS and info["source"]["text_tokens"] > TOKENS
    assert info["source"]["text"].endswith("notes.txt")
    assert info["pass"] == [f"given token ids: {TOKENS} tokens"]  # the pass's own line


def test_the_budget_reaches_the_pass_and_buys_8_bit_layers(calibrated):
    data, seen = calibrated
    assert seen["budgets"] == [0.25] and data["int4_calibration"]["budget"] == 0.25
    record = next(r for r in data["passes"] if r["name"] == "quantize_int4")
    bits = [layer.get("bits", 4) for layer in record["stats"]["layers"]]
    assert 8 in bits and 4 in bits  # 0.25 of fp32 holds some 8-bit layers, not all
    assert record["stats"]["bytes_ratio_fp32"] <= 0.25


def test_without_a_text_the_summary_says_round_to_nearest_calibrated_nothing(tmp_path):
    result = CliRunner().invoke(app, ["export", "llama-tiny", "-o", str(tmp_path / "q.onnx"), "--int4",
                                      "--no-validate"], terminal_width=300)
    assert result.exit_code == 0, result.output + repr(result.exception)
    line = next(line for line in result.stdout.splitlines() if line.startswith("INT4 "))
    assert "round-to-nearest" in line and "--calibration-text" in line


def error_lines(args, tmp_path, capsys, monkeypatch) -> list[str]:
    from graphopt.cli import main

    monkeypatch.setattr("sys.argv", ["graphopt", "export", *args, "-o", str(tmp_path / "m.onnx")])
    with pytest.raises(SystemExit) as exit_info:
        main.main()
    assert exit_info.value.code == 2
    assert not (tmp_path / "m.onnx").exists()
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize("kind", ["missing", "empty", "folder", "binary"])
def test_a_bad_calibration_file_is_one_error_line(kind, checkpoint, tmp_path, capsys, monkeypatch):
    bad = tmp_path / "text.txt"
    if kind == "empty":
        bad.write_text("  \n", encoding="utf-8")
    elif kind == "folder":
        bad.mkdir()
    elif kind == "binary":
        bad.write_bytes(b"\xff\xfe\x00\x81" * 16)
    lines = error_lines([str(checkpoint), "--int4", "--calibration-text", str(bad)], tmp_path, capsys, monkeypatch)
    expected = {"missing": "does not exist", "empty": "is empty", "folder": "is a folder", "binary": "is not UTF-8"}
    assert len(lines) == 1 and lines[0].startswith(f"error: --calibration-text {bad} {expected[kind]}"), lines


def test_a_model_without_a_tokenizer_is_one_error_line_naming_the_fix(tmp_path, capsys, monkeypatch):
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    lines = error_lines(["llama-tiny", "--int4", "--calibration-text", str(text)], tmp_path, capsys, monkeypatch)
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: --calibration-text needs the model's tokenizer: llama-tiny has no tokenizer")
    assert "drop --calibration-text" in lines[0] and ".gguf" in lines[0]


@pytest.mark.parametrize("args, fix", [
    (["--calibration-text", "x.txt"], "add --int4"),
    (["--int4-budget", "0.2"], "add --int4"),
    (["--int4", "--int4-budget", "1.5"], "--int4-budget: budget must be"),
    (["--int4", "--calibration-tokens", "64"], "add --calibration-text FILE"),
    (["--embedding-bits", "8"], "add --int4"),
    (["--int4", "--embedding-bits", "3"], "--embedding-bits: embedding_bits 3 is not valid; choose 0"),
])
def test_a_flag_that_cannot_apply_is_one_error_line(args, fix, tmp_path, capsys, monkeypatch):
    lines = error_lines(["llama-tiny", *args], tmp_path, capsys, monkeypatch)
    assert len(lines) == 1 and lines[0].startswith("error: ") and fix in lines[0], lines
    assert os.listdir(tmp_path) == []


def test_the_help_teaches_the_flags():
    out = CliRunner().invoke(app, ["export", "--help"], terminal_width=200).stdout
    for flag in ("--calibration-text", "--calibration-tokens", "--int4-budget", "--embedding-bits"):
        assert flag in out
    assert "tokenizer" in out and "8 bits" in out


def test_a_config_json_finds_the_tokenizer_of_its_checkpoint(checkpoint, tmp_path):
    from graphopt.sources.tokenizers import load_tokenizer
    from graphopt.errors import ModelLoadError

    assert load_tokenizer(str(checkpoint / "config.json"))("the cat")["input_ids"] == \
        text_model.tokenizer()("the cat")["input_ids"]
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="has no tokenizer"):  # a config alone has none
        load_tokenizer(str(tmp_path / "config.json"))


@pytest.mark.parametrize("bits", [0, 8])
def test_embedding_bits_quantizes_the_table_and_the_bytes_count_it(bits, tmp_path):
    """--embedding-bits 8: the file's embedding is a GatherBlockQuantized and the INT4 byte
    count includes it; 0 keeps the float Gather (the default)."""
    result = CliRunner().invoke(app, ["export", "llama-tiny", "-o", str(tmp_path / "q.onnx"), "--int4",
                                      "--embedding-bits", str(bits), "--json"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    data = json.loads(result.stdout)
    assert data["ok"] and data["int4_calibration"]["embedding_bits"] == bits
    (model,) = data["files"]
    gathers = model["fused_ops"].get("com.microsoft::GatherBlockQuantized", 0)
    assert gathers == (1 if bits else 0), model["fused_ops"]
    assert model["int4"]["embeddings"] == gathers
