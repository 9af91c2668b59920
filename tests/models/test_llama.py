"""The reference Llama: deterministic builds, a KV cache that agrees with a full forward, and
agreement with transformers' LlamaForCausalLM on the same weights (so it is a real Llama)."""

from __future__ import annotations

import pytest
import torch

from graphopt import models
from graphopt.models.llama import LlamaConfig, LlamaForCausalLM, param_count

ATOL = 1e-5


@pytest.fixture(scope="module")
def tiny() -> LlamaForCausalLM:
    return models.build("llama-tiny", seed=0)


def tokens(n: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


def test_build_is_deterministic_per_seed():
    a, b, c = (models.build("llama-tiny", seed=s) for s in (0, 0, 1))
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), name
        assert not torch.equal(pa, pc), name
    assert not a.training


def test_outputs_are_not_degenerate(tiny):
    logits, cache = tiny(tokens(16))
    assert logits.shape == (1, 16, 256)
    assert logits.std() > 0.05  # not all-equal logits
    assert len(cache) == 2 and cache[0][0].shape == (1, 2, 16, 16)
    norm = tiny.layers[0].input_layernorm.weight
    assert not torch.allclose(norm, torch.ones_like(norm))


def test_param_count_matches_the_module(tiny):
    assert param_count(tiny.config) == sum(p.numel() for p in tiny.parameters())


def test_llama_small_is_about_156m_parameters():
    assert param_count(models.config_of("llama-small")) == 155_730_944


def test_kv_cache_decode_matches_full_forward(tiny):
    ids = tokens(12, batch=2)
    full, _ = tiny(ids)
    logits, cache = tiny(ids[:, :8])
    steps = [logits]
    for i in range(8, 12):
        logits, cache = tiny(ids[:, i : i + 1], past_key_values=cache)
        steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=ATOL, rtol=0)
    assert cache[0][0].shape == (2, 2, 12, 16)


def test_chunk_with_past_uses_bottom_right_causal_mask(tiny):
    ids = tokens(12)
    full, _ = tiny(ids)
    head, cache = tiny(ids[:, :5])
    tail, _ = tiny(ids[:, 5:], past_key_values=cache)
    torch.testing.assert_close(torch.cat((head, tail), dim=1), full, atol=ATOL, rtol=0)


def test_explicit_position_ids_equal_the_default(tiny):
    ids = tokens(6)
    torch.testing.assert_close(tiny(ids, position_ids=torch.arange(6)[None])[0], tiny(ids)[0])


def test_rejects_gqa_head_counts_that_do_not_divide():
    with pytest.raises(ValueError, match="num_kv_heads"):
        LlamaConfig(vocab_size=8, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=3, intermediate_size=8)


def test_matches_transformers_llama(tiny):
    transformers = pytest.importorskip("transformers")
    c = tiny.config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        rms_norm_eps=c.rms_eps, max_position_embeddings=c.max_seq_len, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
    )
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    # Our names are Hugging Face's without the "model." prefix of the decoder body.
    state = {(k if k.startswith("lm_head.") else f"model.{k}"): v for k, v in tiny.state_dict().items()}
    hf.load_state_dict(state, strict=True)
    ids = tokens(10, batch=2)
    with torch.no_grad():
        expected = hf(input_ids=ids, use_cache=False).logits
        actual, _ = tiny(ids)
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)
