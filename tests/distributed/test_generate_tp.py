"""``graphopt generate MODEL --tp 2``: the real command on 2 gloo ranks gives, for each
prompt of a left-padded batch, the tokens the same command gives without --tp (TP=1).

The model is a tiny transformers Llama (4 heads, 2 kv heads) with a word-level tokenizer,
saved as a checkpoint directory (tests/generate/text_model.py). Few steps keep the two
spawned ranks cheap; the 32-step check is ``graphopt generate ... -n 32 --tp 2`` by hand.
"""

import json

import pytest
from typer.testing import CliRunner

from graphopt.cli.main import app
from tests.generate import text_model

pytest.importorskip("transformers")
PROMPTS = ["the cat sat on the mat and", "a dog"]  # two lengths: a left-padded batch


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return text_model.save(tmp_path_factory.mktemp("tiny-text-tp"))


def generate(*args: str):
    return CliRunner().invoke(app, ["generate", *args])


def as_json(result) -> dict:
    assert result.exit_code == 0, result.output + repr(result.exception)
    return json.loads(result.stdout)


def test_two_ranks_give_the_tokens_of_one(checkpoint):
    prompts = [a for p in PROMPTS for a in ("-p", p)]
    common = [str(checkpoint), *prompts, "-n", "6", "--target", "eager", "--json"]
    single = as_json(generate(*common))
    sharded = as_json(generate(*common, "--tp", "2"))
    assert sharded["tp"] == 2 and len(sharded["ranks"]) == 2 and sharded["backend"] == "gloo"
    assert sharded["tokens_match_tp1"], [(r["rank"], r["first_mismatch"]) for r in sharded["ranks"]]
    for rank in sharded["ranks"]:
        assert rank["target"] == "eager" and rank["fallback"] is None
        assert rank["token_ids"] == [item["token_ids"] for item in single["outputs"]]
    for ours, theirs in zip(sharded["outputs"], single["outputs"]):
        assert ours == theirs  # prompt, text and new token ids
    assert any(item["token_ids"] for item in sharded["outputs"])  # it decoded something


def test_text_mode_prints_one_table(checkpoint):
    result = generate(str(checkpoint), "-p", "a dog", "-n", "3", "--target", "eager", "--tp", "2")
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert result.stdout.startswith("a dog")
    assert result.stdout.count("tokens match TP=1") == 1
    assert "--tp 2" in result.stdout


@pytest.mark.parametrize("tp, message", [
    ("0", "--tp must be at least 1 (the number of tensor-parallel ranks), got 0"),
    ("3", "--tp 3: the model's attention heads (4) do not split into 3 equal shards; pick a --tp that divides 4"),
])
def test_bad_tp_is_one_line(checkpoint, tp, message):
    result = generate(str(checkpoint), "-p", "a dog", "-n", "2", "--tp", tp)
    assert result.exit_code != 0
    assert str(result.exception) == message
