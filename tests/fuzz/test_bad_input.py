"""Bad input, tried on purpose. Each gets one clear error line (exit status 2) or a reported
fallback, never a traceback, and never a changed or lost file: every file a failed command
was pointed at keeps its bytes and its modification time."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import graphopt
from graphopt.backends.onnxruntime.target import missing_package
from graphopt.cli.main import main
from graphopt.sources import load_model
from graphopt.errors import ModelLoadError, OptionsError

transformers = pytest.importorskip("transformers")


def cli(capsys, *args):
    """Run ``graphopt ARGS`` in-process as the console script does: (status, stdout, stderr)."""
    argv = sys.argv
    sys.argv = ["graphopt", *args]
    try:
        main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code or 0
    finally:
        sys.argv = argv
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, err
    return code, out, err


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))
            if p.is_file()}


def small_llama_dir(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    config.to_json_file(str(folder / "config.json"))
    return folder


# --- unknown options ----------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["run", "llama-tiny", "-o", "nosuch=1"], "unknown graphopt option 'nosuch'; valid options: target"),
    (["run", "llama-tiny", "--target", "gpu"], "target='gpu' is not valid; choose one of: auto, eager"),
    (["run", "llama-tiny", "--repeat", "1", "-o", "pipeline=no_such_pass"], "unknown pass 'no_such_pass'; known passes:"),
    (["run", "llama-tiny", "--repeat", "1", "-o", 'pass_options={"fuse_rms_norm": {"bogus": 1}}'],
     "unknown option(s) bogus for pass fuse_rms_norm"),
    (["fuzz", "--graphs", "1", "--target", "nosuch"], "target='nosuch' is not valid"),
    (["fuzz", "--graphs", "1", "--only", "plant_nothing"], "unknown step kind(s) plant_nothing; valid:"),
])
def test_unknown_option_is_one_error_line(capsys, args, message):
    code, _, err = cli(capsys, *args)
    assert code == 2 and message in one_error_line(err)


def test_unknown_option_through_the_api_is_an_options_error():
    with pytest.raises(OptionsError, match="unknown graphopt option 'bogus'") as info:
        graphopt.compile(nn.Linear(2, 2), {"bogus": 1})
    assert "\n" not in str(info.value)


# --- a model with ops a target cannot take ------------------------------------------------------------

class CumMax(nn.Module):
    """aten.cummax has no ONNX translation in torch.onnx."""

    def forward(self, x):
        return torch.cummax(x * 2, -1)[0] + 1


def compile_and_run(module, options, *inputs):
    torch._dynamo.reset()
    graphopt.reset()
    with torch.no_grad():
        out = torch.compile(module, backend="graphopt", options=options)(*inputs)
    torch.testing.assert_close(out, module(*inputs))
    (report,) = graphopt.reports()
    return report


def test_op_without_onnx_translation_runs_eagerly_alone_and_is_reported():
    if (missing := missing_package()) is not None:  # optional third-party packages; graphopt's module is imported above
        pytest.skip(f"the onnxruntime target needs {missing}: pip install 'graphopt[onnxruntime]'")
    report = compile_and_run(CumMax(), {"target": "onnxruntime"}, torch.randn(3, 8))
    assert report.target == "onnxruntime" and report.fallbacks == []  # the rest of the graph stays on ORT
    (row,) = report.to_dict()["off_target_ops"]
    assert (row["op"], row["count"], row["how"]) == ("aten.cummax", 1, "eager") and "no translation" in row["reason"]
    assert compile_and_run(CumMax(), {"target": "eager"}, torch.randn(3, 8)).fallbacks == []


class Norm(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_graphopt_op_without_onnx_translation_is_decomposed_naming_the_op(monkeypatch):
    if (missing := missing_package()) is not None:  # optional third-party packages; graphopt's module is imported above
        pytest.skip(f"the onnxruntime target needs {missing}: pip install 'graphopt[onnxruntime]'")
    from graphopt.backends.onnxruntime.lower import translations

    table = {k: v for k, v in translations.translation_table().items() if k is not torch.ops.graphopt.rms_norm.default}
    monkeypatch.setattr(translations, "translation_table", lambda: table)
    report = compile_and_run(Norm(), {"target": "onnxruntime"}, torch.randn(3, 8))
    assert report.op_counts.get("graphopt.rms_norm") == 1 and report.target == "onnxruntime"
    assert report.fallbacks == []  # exported as its reference's standard ops, not sent to eager
    (row,) = report.to_dict()["off_target_ops"]
    assert (row["op"], row["how"]) == ("graphopt.rms_norm", "decomposed")
    assert "no ONNX Runtime translation" in row["reason"]


# --- corrupt checkpoints and configs ---------------------------------------------------------------------

def corrupt_config(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    return folder


def garbage_weights(folder: Path) -> Path:
    small_llama_dir(folder)
    (folder / "model.safetensors").write_bytes(b"\x00\x01 not a safetensors file" * 20)
    return folder


def truncated_weights(folder: Path) -> Path:
    from safetensors.torch import save_file

    small_llama_dir(folder)
    save_file({"model.embed_tokens.weight": torch.randn(64, 16)}, str(folder / "model.safetensors"))
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    return folder


def pickle_weights(folder: Path) -> Path:
    small_llama_dir(folder)
    torch.save({"w": torch.zeros(2)}, folder / "pytorch_model.bin")
    return folder


@pytest.mark.parametrize("make, message", [
    (corrupt_config, "is not valid JSON"),
    (garbage_weights, "is not a readable safetensors file"),
    (truncated_weights, "is not a readable safetensors file"),
    (pickle_weights, "holds pickle weights"),
], ids=["corrupt_config", "garbage_weights", "truncated_weights", "pickle_weights"])
def test_corrupt_checkpoint_is_one_error_line_and_no_file_changes(capsys, tmp_path, make, message):
    folder = make(tmp_path / "ckpt")
    before = snapshot(folder)
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(folder))
    for command in (["run", str(folder), "--repeat", "1"], ["debug", str(folder)]):
        code, _, err = cli(capsys, *command)
        assert code == 2 and message in one_error_line(err)
    assert snapshot(folder) == before


# --- missing optional packages ---------------------------------------------------------------------------

def test_missing_transformers_names_the_install_command(capsys, tmp_path, monkeypatch):
    folder = small_llama_dir(tmp_path / "ckpt")
    before = snapshot(folder)
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    with pytest.raises(ModelLoadError, match=r"pip install 'graphopt\[hf\]'"):
        load_model(str(folder))
    code, _, err = cli(capsys, "run", str(folder / "config.json"))
    assert code == 2 and "pip install 'graphopt[hf]'" in one_error_line(err)
    assert snapshot(folder) == before


def hide_package(monkeypatch, name):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a, **k: None if n == name else find_spec(n, *a, **k))


def test_missing_onnxruntime_falls_back_with_the_install_command(capsys, monkeypatch, tmp_path):
    hide_package(monkeypatch, "onnxruntime")
    report = compile_and_run(Norm(), {"target": "onnxruntime"}, torch.randn(3, 8))
    (fallback,) = report.fallbacks
    assert fallback["where"] == "target" and "pip install 'graphopt[onnxruntime]'" in fallback["reason"]
    code, _, err = cli(capsys, "fuzz", "--graphs", "1", "--target", "onnxruntime", "--out", str(tmp_path / "out"))
    assert code == 2 and "no target can run here: onnxruntime" in one_error_line(err)
    assert not (tmp_path / "out").exists()


# --- a target whose hardware is absent ---------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.parametrize("target, reason", [("triton", "GPU"), ("tensorrt", "tensorrt")])
def test_target_without_its_hardware_falls_back_and_says_why(capsys, monkeypatch, target, reason):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the interpreter would make triton runnable on the CPU
    code, out, _ = cli(capsys, "run", "llama-tiny", "--target", target, "--repeat", "1", "--seq-len", "4", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["target"] == "eager" and data["rel_err"] < 1e-5
    fallbacks = [f for r in data["reports"] for f in r["fallbacks"]]
    assert fallbacks and all(f["where"] == "target" and reason in f["reason"] for f in fallbacks)
