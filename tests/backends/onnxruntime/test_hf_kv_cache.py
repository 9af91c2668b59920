"""``--kv-cache`` export and ORT ``--generate`` for transformers causal LMs built from config.json
files: GroupQueryAttention with past/present in the decode model where the mask is only causal,
the greedy tokens and logits of transformers' own forward with its own cache."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from graphopt.cli.main import app
from tests.backends.onnxruntime._helpers import Call, export_and_run, rel_err

transformers = pytest.importorskip("transformers")

from graphopt.backends.onnxruntime.decoder.generate import decode_path, greedy_generate_eager, greedy_generate_ort  # noqa: E402
from graphopt.backends.onnxruntime.runtime.session import SessionRunner, create_session  # noqa: E402
from graphopt.sources import load_model  # noqa: E402
from graphopt.generation.runner import HFCausalStep  # noqa: E402

runner = CliRunner()
GQA, MHA = "com.microsoft::GroupQueryAttention", "com.microsoft::MultiHeadAttention"
LAYERS = 2
TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=256)
# name -> (config.json fields, the attention op each exported model gets)
MODELS = {
    "llama": ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, GQA),
    "qwen2": ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, GQA),  # q/k/v with a bias
    # Mistral-7B-v0.1's 4096-token window lives in the mask: masked attention, MultiHeadAttention.
    "mistral": ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, MHA),
    "mistral-no-window": ({"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": None},
                          GQA),
}


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("hf-configs")
    paths = {}
    for name, (fields, _) in MODELS.items():
        paths[name] = folder / f"{name}.json"
        paths[name].write_text(json.dumps({**TINY, **fields}))
    return paths


@pytest.fixture(scope="module")
def exported(configs, tmp_path_factory) -> dict:
    """name -> (the export's JSON, the prefill path, the model the CLI built, seed 0)."""
    folder = tmp_path_factory.mktemp("hf-onnx")
    out = {}
    for name, config in configs.items():
        path = folder / f"{name}.onnx"
        result = runner.invoke(app, ["export", str(config), "-o", str(path), "--kv-cache", "--json"])
        assert result.exit_code == 0, result.output
        model = load_model(str(config), seed=0, single_output=False).module
        out[name] = json.loads(result.stdout), path, model
    return out


@pytest.mark.parametrize("name", MODELS)
def test_export_fuses_attention(name, exported):
    data, path, _ = exported[name]
    prefill, decode = data["files"]
    attention = MODELS[name][1]
    assert data["ok"] and data["generation"]["tokens_equal"] and not data["fallbacks"]
    assert decode["path"] == str(decode_path(path))
    assert decode["inputs"][:3] == ["input_ids", "past_key_0", "past_value_0"]
    assert decode["outputs"][:3] == ["logits", "present_key_0", "present_value_0"]
    for f in (prefill, decode):
        assert f["fused_ops"].get(attention) == LAYERS, f["fused_ops"]
        assert f["fused_ops"]["com.microsoft::RotaryEmbedding"] == 2 * LAYERS  # q and k
        assert all(row["rel_err"] < 1e-4 for row in f["validation"])
    if attention == GQA:  # the decode step attends over its past inside GroupQueryAttention
        assert data["cached_attention"] == LAYERS and "attention_mask_kept" not in data
    else:
        assert data["cached_attention"] == 0 and "sliding window" in data["attention_mask_kept"]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("batch, length", [(1, 3), (2, 7), (1, 11)])
def test_tokens_and_logits_equal_transformers(name, batch, length, exported):
    _, path, model = exported[name]
    prompt = torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(length))
    prefill = SessionRunner(create_session(str(path)))
    decode = SessionRunner(create_session(str(decode_path(path))))
    tokens = greedy_generate_ort(prefill, decode, prompt, 8)
    assert tokens.shape == (batch, length + 8)
    assert torch.equal(tokens, greedy_generate_eager(model, prompt, 8))
    # One prefill and one step against transformers' forward with its own DynamicCache.
    with torch.no_grad():
        eager = model(input_ids=prompt, use_cache=True)
        logits, *present = prefill(prompt)
        assert rel_err(logits[:, -1], eager.logits[:, -1]) < 1e-4
        token = logits[:, -1:].argmax(-1)
        cache_arg = HFCausalStep(model).cache_arg  # transformers 5 renamed past_key_values to cache
        eager_step = model(input_ids=token, use_cache=True, **{cache_arg: getattr(eager, cache_arg)})
        step_logits, *_ = decode(token, *present)
        assert rel_err(step_logits[:, -1], eager_step.logits[:, -1]) < 1e-4


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_generate_on_onnxruntime_matches_eager(name, configs):
    result = runner.invoke(app, ["run", str(configs[name]), "--target", "onnxruntime", "--generate", "6",
                                 "--seq-len", "5", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    block = data["generate"]
    assert data["target"] == "onnxruntime"
    assert block["tokens_match_eager"] is True and block["fallback"] is None and block["compiles"] == 1


def test_skips_kv_cache_for_an_encoder(tmp_path):
    config = tmp_path / "bert.json"
    config.write_text(json.dumps({"model_type": "bert", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 1,
                                  "num_attention_heads": 4, "intermediate_size": 128}))
    result = runner.invoke(app, ["export", str(config), "-o", str(tmp_path / "m.onnx"), "--kv-cache"])
    assert result.exit_code != 0
    message = str(result.exception)
    assert "\n" not in message and message.startswith("BertModel has no KV cache to export")
    assert message.endswith("hf-encoder model: export it without --kv-cache")
    assert not list(tmp_path.glob("*.onnx"))


def test_skips_cache_form_for_an_empty_dynamic_cache():
    """transformers' DynamicLayer concatenates the prompt's keys onto a 1-D empty tensor: that is
    attention without a past (plain GroupQueryAttention), even for a batch of one."""

    def prompt_attention(q, k, v):
        empty = torch.tensor([])
        return torch.ops.graphopt.attention(q, torch.cat([empty, k], -2), torch.cat([empty, v], -2), None, None, True)

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 5, 16, generator=gen) for h in (4, 2, 2))
    module = Call(lambda s, *a: prompt_attention(*a))
    (out,), model = export_and_run(module, q, k, v)
    assert rel_err(out, module(q, k, v)) < 1e-5
    assert model.fused_op_counts() == {GQA: 1} and model.cached_attention == 0


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_plain_export_without_a_cache_fuses_attention_too(name, configs, tmp_path):
    """graphopt export CONFIG (no --kv-cache): the same unmasked sdpa while exporting, so a
    causal LM's prompt attention is GroupQueryAttention, not MHA over a materialized mask."""
    path = tmp_path / "plain.onnx"
    result = runner.invoke(app, ["export", str(configs[name]), "-o", str(path), "--json"])
    assert result.exit_code == 0, result.output
    (model,) = json.loads(result.stdout)["files"]
    assert model["fused_ops"].get(MODELS[name][1]) == LAYERS, model["fused_ops"]
    assert model["outputs"] == ["logits"]
    assert all(row["rel_err"] < 1e-4 for row in model["validation"])  # against the model's own masked attention
