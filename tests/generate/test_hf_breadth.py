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


QWEN2_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64)


@pytest.mark.parametrize("model_type, fields, kept", [
    # Qwen2-MoE keeps sliding_window (0) with every layer full attention: a causal mask only.
    ("qwen2_moe", QWEN2_MOE, None),
    # Qwen2 slides from layer max_window_layers on: 0 windows every layer, 2 (of 2) none.
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0}, "sliding window"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2}, None),
    ("mistral", {"sliding_window": 4}, "sliding window"),
    ("mistral", {"sliding_window": None}, None),
])
def test_mask_is_kept_only_for_a_window_some_layer_uses(model_type, fields, kept):
    from graphopt.sources.transformers_attention import mask_kept

    reason = mask_kept(tiny(model_type, **fields))
    assert reason is None if kept is None else kept in reason


def test_qwen2_moe_decodes_on_the_in_place_decoder():
    model = tiny("qwen2_moe", **QWEN2_MOE)
    ids = prompt()
    out = graphopt.generate(model, ids, 6, options={"target": "onnxruntime", "fallback": "error"})
    assert out.fallback is None and torch.equal(out.sequences, eager_generate(model, ids, 6).sequences)
    assert not any("two models" in note for note in out.notes), out.notes  # the in-place decoder, not the pair


FALCON_ALIBI = dict(num_key_value_heads=4, multi_query=False, new_decoder_architecture=False, parallel_attn=False,
                    alibi=True, bias=True)


def test_alibi_keeps_the_mask():
    """Falcon-RW adds its ALiBi bias into the mask (and reads the mask's dtype): without the mask
    its forward crashed while exporting, and generate fell back with an AttributeError."""
    from graphopt.sources.transformers_attention import mask_kept

    assert "ALiBi" in mask_kept(tiny("falcon", **FALCON_ALIBI))
    assert mask_kept(tiny("falcon", num_key_value_heads=4, new_decoder_architecture=True)) is None  # rotary Falcon


def test_falcon_alibi_falls_back_naming_its_own_bfloat16():
    """Falcon's ALiBi slopes are computed in bfloat16 whatever the model's dtype, and ORT's CPU
    provider has no bfloat16 Mul: generate decodes eagerly, saying so in one line that does not
    tell the user to cast an fp32 model to fp32."""
    model = tiny("falcon", **FALCON_ALIBI)
    ids = prompt()
    out = graphopt.generate(model, ids, 4, options={"target": "onnxruntime"})
    assert out.fallback is not None and "\n" not in out.fallback
    assert "no bfloat16 kernel for Mul" in out.fallback and "own code" in out.fallback, out.fallback
    assert "model.float()" not in out.fallback
    assert torch.equal(out.sequences, eager_generate(model, ids, 4).sequences)


@pytest.mark.parametrize("target", ["eager", "onnxruntime"])
@pytest.mark.parametrize("model_type, fields", [("llama", {}), ("gpt2", {"n_embd": 64, "n_layer": 2, "n_head": 4})])
def test_compiled_forward_of_a_left_padded_batch_matches_eager(model_type, fields, target):
    """torch.compile on a left-padded batch: the fused attention gave NaN for the pad queries
    (they see no key), and the next layer made the whole padded row NaN."""
    model = tiny(model_type, **fields)
    ids = prompt(2, 7)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="graphopt", options={"target": target, "fallback": "error"})
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        got = compiled(input_ids=ids, attention_mask=mask).logits
    torch._dynamo.reset()
    assert not got.isnan().any()
    assert ((got - want).norm() / want.norm()).item() < 1e-5
