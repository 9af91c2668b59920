"""``graphopt export``: writes a validated model with ORT's fused ops, never half a file, never
over an existing one without --force; bad input gets one error line; --kv-cache generates
the same tokens as eager."""

from __future__ import annotations

import json
import os

import pytest
import torch
from typer.testing import CliRunner

from graphopt import models
from graphopt.backends.onnxruntime.lower import onnx_model
from graphopt.backends.onnxruntime.decoder.generate import decode_path, export_kv_cache, greedy_generate_eager, \
    greedy_generate_ort
from graphopt.cli.main import app
from graphopt.config import Options
from tests.backends.onnxruntime._helpers import rel_err  # noqa: F401  (skips without onnxruntime)

runner = CliRunner()
GQA = "com.microsoft::GroupQueryAttention"


def export_json(*args: str) -> dict:
    result = runner.invoke(app, ["export", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def fails_with(args: list[str], message: str, capsys, monkeypatch) -> None:
    from graphopt.cli import main

    monkeypatch.setattr("sys.argv", ["graphopt", "export", *args])
    with pytest.raises(SystemExit) as exit_info:
        main.main()
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], errors


def test_export_writes_a_model_that_matches_eager_on_two_shapes(tmp_path):
    path = tmp_path / "llama.onnx"
    data = export_json("llama-tiny", "-o", str(path))
    (model,) = data["files"]
    assert data["ok"] and model["path"] == str(path) and path.stat().st_size == model["size_bytes"]
    assert model["export_route"] == "direct"  # no torch.onnx re-trace (direct_export.py)
    shapes = [row["input_shapes"][0] for row in model["validation"]]
    assert shapes == [[2, 16], [3, 19]]  # the second set runs the dynamic batch and sequence axes
    assert all(row["rel_err"] < 1e-4 for row in model["validation"])
    graphopt_ops = model["graphopt_ops"]
    assert model["fused_ops"]["com.microsoft::SkipSimplifiedLayerNormalization"] == graphopt_ops["graphopt.add_rms_norm"]
    assert model["fused_ops"]["SimplifiedLayerNormalization"] == graphopt_ops["graphopt.rms_norm"]
    for op, ort_op in (("graphopt.rope", "com.microsoft::RotaryEmbedding"), ("graphopt.attention", GQA)):
        assert model["fused_ops"].get(ort_op, 0) == graphopt_ops.get(op, 0)
    assert set(data["stages_s"]) == {"load", "torch.export", "passes", "onnx export", "save", "validate"}
    assert os.listdir(tmp_path) == ["llama.onnx"]  # no temporary files left behind
    names = [p["name"] for p in data["passes"]]  # the ONNX-level passes follow the FX ones, reported alike
    first_onnx = next(i for i, name in enumerate(names) if name.startswith("onnx:"))
    assert "fuse_rms_norm" in names[:first_onnx] and all(n.startswith("onnx:") for n in names[first_onnx:])
    assert any(p["name"] == "onnx:light_cleanup" and p["matches"] > 0 for p in data["passes"])


def test_refuses_to_overwrite_without_force(tmp_path, capsys, monkeypatch):
    path = tmp_path / "m.onnx"
    path.write_bytes(b"keep me")
    fails_with(["llama-tiny", "-o", str(path)], f"{path} exists; pass --force to overwrite it", capsys, monkeypatch)
    assert path.read_bytes() == b"keep me"
    data = export_json("llama-tiny", "-o", str(path), "--force", "--no-validate")
    assert path.stat().st_size == data["files"][0]["size_bytes"] > 1000


def test_interrupted_export_leaves_no_file(tmp_path, monkeypatch):
    real_save = onnx_model.OnnxModel.save

    def save_then_interrupt(self, target):
        real_save(self, target)  # a complete file in the temporary folder...
        raise KeyboardInterrupt  # ...and the user presses ^C before it is moved into place

    monkeypatch.setattr(onnx_model.OnnxModel, "save", save_then_interrupt)
    result = runner.invoke(app, ["export", "llama-tiny", "-o", str(tmp_path / "m.onnx"), "--no-validate"])
    assert result.exit_code != 0
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("content, message", [
    ('{"model_type": "llama", "hidden_size": 64', "is not valid JSON"),
    ('{"hidden_size": 64}', 'has no "model_type"'),
])
def test_corrupt_model_gets_one_error_line(tmp_path, content, message, capsys, monkeypatch):
    config = tmp_path / "config.json"
    config.write_text(content)
    fails_with([str(config), "-o", str(tmp_path / "m.onnx")], message, capsys, monkeypatch)
    assert not (tmp_path / "m.onnx").exists()


def test_int4_without_the_quantization_pass_says_so(tmp_path, capsys, monkeypatch):
    from graphopt.registry import scoped_passes

    with scoped_passes(remove=("quantize_int4",)):
        fails_with(["llama-tiny", "-o", str(tmp_path / "m.onnx"), "--int4"],
                   "--int4 needs the quantize_int4 pass, which this graphopt version does not have yet", capsys, monkeypatch)


def test_kv_cache_export_generates_eager_tokens(tmp_path):
    data = export_json("llama-tiny", "-o", str(tmp_path / "llama.onnx"), "--kv-cache", "--new-tokens", "8")
    assert data["ok"] and data["generation"]["tokens_equal"]
    prefill, decode = data["files"]
    assert decode["path"] == str(tmp_path / "llama.decode.onnx")
    assert decode["inputs"][:3] == ["input_ids", "past_key_0", "past_value_0"]
    assert decode["outputs"][:3] == ["logits", "present_key_0", "present_value_0"]
    layers = models.config_of("llama-tiny").num_layers
    if decode["graphopt_ops"].get("graphopt.attention"):  # fuse_attention is in the pipeline
        assert prefill["fused_ops"][GQA] == decode["fused_ops"][GQA] == layers
        assert data["cached_attention"] == layers  # decode attends over its past inside GQA
    assert all(row["rel_err"] < 1e-4 for f in data["files"] for row in f["validation"])


def test_greedy_generation_on_ort_equals_eager_for_another_prompt(tmp_path):
    model = models.build("llama-tiny", seed=3)
    (prompt,) = models.example_inputs(model, batch=2, seq_len=6, seed=3)
    export_kv_cache(model, prompt, tmp_path / "m.onnx", config=Options(), validate_model=False)
    # A batch of one and a longer prompt than the export's: dynamic batch, sequence and past.
    (other,) = models.example_inputs(model, batch=1, seq_len=11, seed=4)
    tokens = greedy_generate_ort(str(tmp_path / "m.onnx"), str(decode_path(tmp_path / "m.onnx")), other, 8)
    assert tokens.shape == (1, 19)
    assert torch.equal(tokens, greedy_generate_eager(model, other, 8))


def test_models_over_the_protobuf_limit_keep_weights_outside(tmp_path, monkeypatch):
    # 2 GB of weights is too much for a unit test: lower the threshold instead.
    monkeypatch.setattr(onnx_model, "LARGE_MODEL_BYTES", 10_000)
    data = export_json("llama-tiny", "-o", str(tmp_path / "m.onnx"))
    (model,) = data["files"]
    assert model["files"] == [str(tmp_path / "m.onnx.data"), str(tmp_path / "m.onnx")]
    import onnx

    # Every weight lives in the data file; the model file holds the graph (with each node's
    # source line as metadata) and small constants only.
    graph = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False).graph
    inline = [t.name for t in graph.initializer
              if t.data_location != onnx.TensorProto.EXTERNAL and len(t.raw_data) > 1024]
    assert inline == []
    assert (tmp_path / "m.onnx").stat().st_size < (tmp_path / "m.onnx.data").stat().st_size
    assert data["ok"]  # validation loaded the weights from the data file
