"""``graphopt run MODEL --generate N`` (graphopt.generate with the eager reference) and the ORT runner."""

import json

import pytest
from typer.testing import CliRunner

import graphopt
from graphopt.cli import run_cmd
from graphopt.cli.main import app
from graphopt.config import Options
from graphopt.errors import GraphoptError
from graphopt.generation import generate_with_reference


def test_generate_json_block():
    result = CliRunner().invoke(app, ["run", "llama-tiny", "--generate", "6", "--seq-len", "4", "--target", "eager",
                                      "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    block = data["generate"]
    assert {"tokens_match_eager", "compiles", "ms_per_token"} <= set(block)
    assert block["tokens_match_eager"] is True and block["compiles"] == 1 and block["prefill_compiles"] == 1
    assert len(block["ms_per_token"]) == 5 and len(block["eager_ms_per_token"]) == 5
    assert data["target"] == "eager" and data["reports"] and block["fallback"] is None


def test_generate_needs_a_causal_lm():
    result = CliRunner().invoke(app, ["run", "bert-tiny", "--generate", "4"])
    assert result.exit_code != 0 and "--generate needs a causal LM; bert-tiny is a bert model" in str(result.exception)


def test_run_generate_on_auto_names_the_target_that_decoded(monkeypatch):
    """run --generate goes through graphopt.generation; the JSON names the runner's target."""
    from graphopt.generation import api

    monkeypatch.setattr(api, "resolve_name", lambda config: "eager")
    result = CliRunner().invoke(app, ["run", "llama-tiny", "--generate", "3", "--seq-len", "4", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["target"] == "eager"


def test_a_runner_that_does_not_load_says_so(monkeypatch):
    from graphopt.generation import api

    monkeypatch.setitem(api.RUNNERS, "eager", "tests.generate.no_such_module:Runner")
    with pytest.raises(GraphoptError, match="step runner tests.generate.no_such_module:Runner does not load"):
        api.make_runner(None, Options.parse({"target": "eager"}), 8)


ort = pytest.importorskip("onnxruntime")


def test_generate_on_onnxruntime_matches_eager_tokens():
    """The exported prefill + decode-step models (GQA with past/present) decode the same
    greedy tokens as eager; export time is compile time, not decode time."""
    result = CliRunner().invoke(app, ["run", "llama-tiny", "--generate", "8", "--seq-len", "5",
                                      "--target", "onnxruntime", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    block = data["generate"]
    assert data["target"] == "onnxruntime" and block["fallback"] is None
    assert block["tokens_match_eager"] is True and block["compiles"] == 1
    assert len(block["ms_per_token"]) == 7 and block["compile_s"] > 0


def test_generate_on_onnxruntime_batch_of_two():
    import torch

    from graphopt import models
    model = models.build("llama-tiny").eval()
    ids = models.example_inputs("llama-tiny", batch=2, seq_len=3, seed=3)[0]
    out, ref = generate_with_reference(model, ids, 5, options={"target": "onnxruntime"})
    assert out.fallback is None and out.sequences.shape == (2, 8) and out.target == "onnxruntime"
    assert torch.equal(out.sequences, ref.sequences)


def test_generate_on_onnxruntime_refuses_a_model_without_an_explicit_cache():
    import torch

    from graphopt.backends.onnxruntime.decoder.decoder import OrtRunner

    with pytest.raises(GraphoptError, match="like graphopt's built-in Llama.*use --target eager"):
        OrtRunner(torch.nn.Linear(4, 4), Options.parse({"target": "onnxruntime"}))


def test_generate_on_onnxruntime_falls_back_when_export_fails(monkeypatch):
    from graphopt import models
    from graphopt.backends.onnxruntime.decoder import generate as ort_files, inplace_cache

    def broken(*args, **kwargs):
        raise RuntimeError("exporter exploded")

    monkeypatch.setattr(ort_files, "export_kv_cache", broken)  # the prefill/decode pair
    monkeypatch.setattr(inplace_cache, "export_decoder", broken)  # the in-place decoder
    model = models.build("llama-tiny").eval()
    ids = models.example_inputs("llama-tiny", batch=1, seq_len=4, seed=0)[0]
    out, ref = generate_with_reference(model, ids, 3, options={"target": "onnxruntime"})
    assert out.fallback == "RuntimeError: exporter exploded" and out.target == "eager"
    assert out.sequences.equal(ref.sequences)
    with pytest.raises(GraphoptError, match="exporter exploded"):
        generate_with_reference(model, ids, 3, options={"target": "onnxruntime", "fallback": "error"})


def test_first_mismatch_names_where_greedy_decoding_diverged():
    import torch

    prompt = torch.tensor([[5, 6], [7, 8]])
    same = torch.cat([prompt, torch.tensor([[1, 2, 3], [4, 5, 6]])], 1)
    assert run_cmd._first_mismatch(same, same.clone(), 2) is None
    other = same.clone()
    other[1, 3] = 9  # the second sequence's second new token
    assert run_cmd._first_mismatch(other, same, 2) == 2
    block = {"tokens_match_eager": False, "first_mismatch": 2, "tokens": 3}
    assert run_cmd._match_text(block) == "no: from token 2 of 3"
