"""graphopt.generate on a transformers Llama: model.generate's greedy tokens, one decode compilation."""

import pytest
import torch

import graphopt

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_llama():
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).eval()


def test_greedy_tokens_equal_model_generate(hf_llama):
    prompt = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf_llama.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    out = graphopt.generate(hf_llama, prompt, 16, options={"target": "eager", "fallback": "error"})
    assert torch.equal(out.sequences, expected)
    assert out.compiles == 1 and len(out.ms_per_token) == 15
    decode = out.reports[-1]
    stats = {p.name: p.stats for p in decode.passes}["static_kv_cache"]
    assert stats["caches"] == 4 and stats["matches"] == 4
    # transformers builds its causal mask from the past length: as positions it became the
    # position input, as sizes max_length; nothing symbolic is left.
    # Both layers' rotations and K/V writes folded into one op each (fuse_rope_kv_cache_update).
    assert decode.op_counts["graphopt.rope_kv_cache_update"] == 2 and "graphopt.rope" not in decode.op_counts
