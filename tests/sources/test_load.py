"""load_model: built-in names, Hugging Face configs and safetensors checkpoints, factories,
and one clear ModelLoadError line for every way a spec can be wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from graphopt import models
from graphopt.sources import LoadedModel, load_model
from graphopt.errors import ModelLoadError

transformers = pytest.importorskip("transformers")


def small_llama_config(**overrides) -> "transformers.LlamaConfig":
    fields = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaConfig(**{**fields, **overrides})


def small_bert_config() -> "transformers.BertConfig":
    return transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                   intermediate_size=64, max_position_embeddings=64)


def run(loaded: LoadedModel) -> torch.Tensor:
    with torch.no_grad():
        return loaded.module(*loaded.example_inputs)


def load_error(spec: str, match: str) -> str:
    with pytest.raises(ModelLoadError, match=match) as info:
        load_model(spec)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- built-in names -----------------------------------------------------------------------


def test_builtin_llama_returns_logits_only():
    loaded = load_model("llama-tiny", batch=2, seq_len=8)
    assert loaded.family == "llama" and loaded.name == "llama-tiny"
    assert loaded.example_inputs[0].shape == (2, 8)
    logits = run(loaded)
    expected, _ = models.build("llama-tiny")(*loaded.example_inputs)
    torch.testing.assert_close(logits, expected)


def test_builtin_llama_raw_module_keeps_the_cache():
    loaded = load_model("llama-tiny", single_output=False)
    logits, cache = run(loaded)
    assert logits.shape == (1, 16, 256) and len(cache) == 2


def test_builtin_bert():
    loaded = load_model("bert-tiny", seed=2)
    assert loaded.family == "bert" and len(loaded.example_inputs) == 2
    assert run(loaded).shape == (1, 16, 64)


def test_unknown_name_lists_the_built_in_names():
    assert "llama-tiny" in load_error("llama-gigantic", "unknown model")


def test_sequence_longer_than_the_model_is_refused():
    with pytest.raises(ModelLoadError, match="seq_len"):
        load_model("bert-tiny", seq_len=4096)


# --- Hugging Face configs -----------------------------------------------------------------


def test_config_json_builds_a_seeded_causal_lm(tmp_path: Path):
    small_llama_config(architectures=["LlamaForCausalLM"], dtype="bfloat16").to_json_file(tmp_path / "config.json")
    state = torch.random.get_rng_state()
    a = load_model(str(tmp_path / "config.json"), seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG is untouched
    b = load_model(str(tmp_path / "config.json"), seed=3)
    assert a.family == "hf-causal-lm"
    logits = run(a)
    assert logits.shape == (1, 16, 128) and logits.dtype == torch.float32
    torch.testing.assert_close(run(b), logits, atol=0, rtol=0)


def test_bert_config_without_architectures_is_an_encoder(tmp_path: Path):
    small_bert_config().to_json_file(tmp_path / "config.json")
    loaded = load_model(str(tmp_path), seq_len=8)  # a directory with no weights: random ones
    assert loaded.family == "hf-encoder"
    assert run(loaded).shape == (1, 8, 32)


def test_corrupt_config_json(tmp_path: Path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", ')
    load_error(str(tmp_path / "config.json"), "not valid JSON")


def test_config_without_model_type(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    load_error(str(tmp_path), "model_type")


def test_unknown_model_type(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-arch"}))
    load_error(str(tmp_path), "no-such-arch")


def test_missing_path():
    load_error("/nonexistent/dir/config.json", "no such file")


def test_directory_without_config(tmp_path: Path):
    load_error(str(tmp_path), "no config.json")


# --- safetensors checkpoints --------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_safetensors_checkpoint_loads_its_weights(tmp_path: Path, tied: bool):
    torch.manual_seed(7)
    hf = transformers.LlamaForCausalLM(small_llama_config(tie_word_embeddings=tied)).eval()
    hf.save_pretrained(tmp_path)
    assert list(tmp_path.glob("*.safetensors"))
    loaded = load_model(str(tmp_path), seed=123)
    with torch.no_grad():
        expected = hf(input_ids=loaded.example_inputs[0], use_cache=False).logits
    torch.testing.assert_close(run(loaded), expected, atol=0, rtol=0)


def test_task_head_checkpoint_loads_into_the_base_encoder(tmp_path: Path):
    torch.manual_seed(8)
    hf = transformers.BertForMaskedLM(small_bert_config()).eval()
    hf.save_pretrained(tmp_path)  # keys are "bert.encoder...", architectures BertForMaskedLM
    loaded = load_model(str(tmp_path), seq_len=8)
    assert loaded.family == "hf-encoder"
    with torch.no_grad():
        expected = hf.bert(*loaded.example_inputs).last_hidden_state
    torch.testing.assert_close(run(loaded), expected, atol=0, rtol=0)


def test_pickle_only_checkpoint_is_refused(tmp_path: Path):
    small_llama_config().to_json_file(tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"never unpickled")
    message = load_error(str(tmp_path), "safetensors")
    assert "pickle" in message and "arbitrary code" in message


def test_corrupt_safetensors(tmp_path: Path):
    small_llama_config().to_json_file(tmp_path / "config.json")
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    load_error(str(tmp_path), "not a readable safetensors file")


def test_weights_of_another_shape_are_refused(tmp_path: Path):
    transformers.LlamaForCausalLM(small_llama_config()).save_pretrained(tmp_path)
    small_llama_config(hidden_size=64).to_json_file(tmp_path / "config.json")
    load_error(str(tmp_path), "do not belong to this config")


# --- package.module:factory ---------------------------------------------------------------


def test_factory_returning_module_and_inputs():
    loaded = load_model("tests.sources.factory_helper:make")
    assert loaded.family == "custom" and loaded.example_inputs[0].shape == (2, 8)
    assert run(loaded).shape == (2, 8)
    assert not loaded.module.training


def test_factory_returning_a_builtin_module_gets_its_inputs():
    loaded = load_model("tests.sources.factory_helper:make_llama", seed=5, seq_len=4)
    logits, _ = run(loaded)  # a factory's module is used as it comes
    assert logits.shape == (1, 4, 256)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("tests.sources.no_such_module:make", "cannot import"),
        ("tests.sources.factory_helper:missing", "no callable"),
        ("tests.sources.factory_helper:not_callable", "no callable"),
        ("tests.sources.factory_helper:broken", "out of coffee"),
        ("tests.sources.factory_helper:make_plain", "without example inputs"),
        ("tests.sources.factory_helper:make:extra", "package.module:function"),
    ],
)
def test_bad_factory_specs(spec: str, match: str):
    load_error(spec, match)
