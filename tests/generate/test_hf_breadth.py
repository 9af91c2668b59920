"""graphopt on transformers causal-LM families beyond Llama (benchmarks/hf_breadth.py sweeps them
all): what broke on one family, pinned with a tiny random model of it."""

from __future__ import annotations

import pytest
import torch

import graphopt
from graphopt.generation import eager_generate

transformers = pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")

TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=256, tie_word_embeddings=False)


def tiny(model_type: str, **fields):
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **fields})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def prompt(batch: int = 2, length: int = 6) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("model_type, fields", [
    ("qwen3", {"head_dim": 16}),  # RMSNorm on q and k: the attention's query had no dtype in ONNX
    ("gpt_neox", {"num_key_value_heads": 4, "rotary_pct": 0.25}),  # rotary on a quarter of each head
])
def test_in_place_ort_decoder_matches_eager(model_type, fields):
    model = tiny(model_type, **fields)
    ids = prompt()
    out = graphopt.generate(model, ids, 6, options={"target": "onnxruntime", "fallback": "error"})
    assert out.fallback is None and out.target == "onnxruntime"
    assert torch.equal(out.sequences, eager_generate(model, ids, 6).sequences)
