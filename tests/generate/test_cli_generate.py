"""``graphopt run MODEL --generate N``: the generate block of its JSON, and its dispatch seam."""

import json

import pytest
from typer.testing import CliRunner

import graphopt
from graphopt.cli import run_cmd
from graphopt.cli.main import app
from graphopt.config import Options
from graphopt.errors import GraphoptError


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


def fake_loop(model, input_ids, max_new_tokens, *, options=None):
    """What a target's own decode loop (greedy_generate_ort) is called like."""
    return ("fake", options["target"])


def test_dispatch_on_the_resolved_target(monkeypatch):
    assert run_cmd._generate_loop(Options.parse({"target": "eager"})) == ("eager", graphopt.generate)
    assert run_cmd._generate_loop(Options.parse({"target": "auto"}))[1] is graphopt.generate
    monkeypatch.setitem(run_cmd.GENERATE_LOOPS, "eager", "tests.generate.test_cli_generate:fake_loop")
    name, loop = run_cmd._generate_loop(Options.parse({"target": "eager"}))
    assert name == "eager" and loop(None, None, 1, options={"target": "eager"}) == ("fake", "eager")
    monkeypatch.setitem(run_cmd.GENERATE_LOOPS, "eager", "tests.generate.no_such_module:loop")
    with pytest.raises(GraphoptError, match="does not load"):
        run_cmd._generate_loop(Options.parse({"target": "eager"}))


def test_a_target_without_a_decode_loop_says_so(monkeypatch):
    from graphopt import targets

    class Other:
        name = "onnxruntime"

    monkeypatch.setattr(targets, "resolve_target", lambda config: (Other(), []))
    with pytest.raises(GraphoptError, match="does not run on target onnxruntime yet"):
        run_cmd._generate_loop(Options.parse({"target": "onnxruntime"}))
    assert run_cmd._generate_loop(Options.parse({"target": "auto"})) == ("eager", graphopt.generate)
