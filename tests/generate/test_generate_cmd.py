"""``graphopt generate MODEL --prompt TEXT``: text in, text out, on a tiny checkpoint with a tokenizer."""

import json

import pytest
import torch
from typer.testing import CliRunner

from graphopt import lazy_weights
from graphopt.cli.main import app
from graphopt.errors import ModelLoadError
from graphopt.generation import StopConditions, eager_generate
from graphopt.generation.checkpoint import Checkpoint

from tests.generate import text_model

pytest.importorskip("transformers")
PROMPTS = ["the cat sat on the mat and", "a dog", "the big red dog runs"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return text_model.save(tmp_path_factory.mktemp("tiny-text"))


def invoke(*args: str) -> dict | str:
    result = CliRunner().invoke(app, ["generate", *args])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return json.loads(result.stdout) if "--json" in args else result.stdout


def alone(folder, prompt: str, new: int) -> list[int]:
    """``prompt`` decoded by itself, eagerly, with the model and tokenizer the CLI loads."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    return eager_generate(model, ids, new, stop=StopConditions((tok.eos_token_id,), pad_token_id=1)).token_ids(0)


@pytest.mark.parametrize("target", ["eager", "onnxruntime"])
def test_three_prompts_in_one_call_each_equal_to_its_prompt_alone(checkpoint, target):
    pytest.importorskip("onnxruntime") if target == "onnxruntime" else None
    args = [str(checkpoint), "--max-new-tokens", "5", "--target", target, "--json"]
    data = invoke(*args, *[a for p in PROMPTS for a in ("--prompt", p)])
    assert data["target"] == target and data["fallback"] is None
    assert set(data) >= {"target", "prefill_ms", "ms_per_token", "outputs"}
    for item, prompt in zip(data["outputs"], PROMPTS):
        assert item["prompt"] == prompt
        assert item["token_ids"] == alone(checkpoint, prompt, 5)  # new tokens only, each as if alone
        assert item["text"] == text_model.tokenizer().decode(item["token_ids"], skip_special_tokens=True)
    assert data["prefill_ms"] > 0 and all(ms > 0 for ms in data["ms_per_token"])
    if target == "onnxruntime":  # the decoder's build, stage by stage (exported, or loaded from the cache)
        assert "session" in data["compile_stages"] and sum(data["compile_stages"].values()) <= data["compile_s"]


def test_text_mode_streams_the_prompt_and_prints_a_summary(checkpoint):
    out = invoke(str(checkpoint), "-p", "the cat", "-n", "4", "--target", "eager")
    first, summary = out.splitlines()[0], out.splitlines()[-1]
    expected = text_model.tokenizer().decode(alone(checkpoint, "the cat", 4), skip_special_tokens=True)
    assert first.startswith("the cat") and first.endswith(expected.split()[-1])
    assert summary.startswith("target eager · prefill ") and "ms/token (median)" in summary and "tokens/s" in summary


def test_chat_wraps_the_prompt_in_the_template(checkpoint):
    data = invoke(str(checkpoint), "--chat", "-p", "dog", "-n", "3", "--target", "eager", "--json")
    # the template makes "user dog then"; the tokens are what that text decodes to
    assert data["outputs"][0]["token_ids"] == alone(checkpoint, "user dog then", 3)


def test_chat_without_a_template_is_one_line(tmp_path):
    folder = text_model.save(tmp_path / "plain", chat=False)
    result = CliRunner().invoke(app, ["generate", str(folder), "--chat", "-p", "dog", "-n", "2"])
    assert result.exit_code != 0
    assert str(result.exception) == (f"the tokenizer of {folder} has no chat template; drop --chat and write the "
                                     "prompt whole")


def test_a_model_without_a_tokenizer_is_refused():
    result = CliRunner().invoke(app, ["generate", "llama-tiny", "-p", "hi"])
    assert result.exit_code != 0 and "llama-tiny has no tokenizer: pass a .gguf file" in str(result.exception)


def test_gguf_without_its_packages_names_them(tmp_path, monkeypatch):
    import importlib.util

    from graphopt.sources import load_model

    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"GGUF")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ModelLoadError, match=r"^reading a \.gguf file needs the packages gguf: pip install gguf$"):
        load_model(str(fake))


def test_help_has_an_example():
    result = CliRunner().invoke(app, ["generate", "--help"])
    assert result.exit_code == 0 and "Example: graphopt generate" in result.stdout


def test_the_int4_flag_reaches_the_options(checkpoint, monkeypatch):
    import graphopt

    seen = {}

    def fake(model, ids, n, **kwargs):  # the CLI hands over a Checkpoint (the folder, built when needed)
        seen.update(kwargs["options"])
        module = model.build() if isinstance(model, Checkpoint) else model
        lazy_weights.materialize_module(module)  # a built checkpoint's weights are still in its files
        mask = kwargs["attention_mask"]
        return eager_generate(module, torch.as_tensor(ids), n, stop=kwargs["stop"],
                              attention_mask=None if mask is None else torch.as_tensor(mask))

    monkeypatch.setattr(graphopt, "generate", fake)
    data = invoke(str(checkpoint), "-p", "a dog", "-n", "2", "--int4", "--target", "eager", "--json")
    assert seen["int4"] is True and seen["target"] == "eager" and data["target"] == "eager"
    assert torch.tensor(data["outputs"][0]["token_ids"]).numel() <= 2
