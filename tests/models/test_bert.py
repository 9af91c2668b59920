"""The reference BERT: deterministic builds, a padding mask that hides padded keys, and
agreement with transformers' BertModel on the same weights."""

from __future__ import annotations

import pytest
import torch

from graphopt import models
from graphopt.models.bert import BertModel, param_count

ATOL = 1e-5


@pytest.fixture(scope="module")
def tiny() -> BertModel:
    return models.build("bert-tiny", seed=0)


def test_build_is_deterministic_per_seed():
    a, b, c = (models.build("bert-tiny", seed=s) for s in (0, 0, 1))
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), name
        assert not torch.equal(pa, pc), name


def test_param_count_matches_the_module(tiny):
    assert param_count(tiny.config) == sum(p.numel() for p in tiny.parameters())


def test_forward_without_mask_equals_all_ones_mask(tiny):
    ids, ones = models.example_inputs(tiny, batch=2, seq_len=8)
    out = tiny(ids)
    assert out.shape == (2, 8, 64)
    assert out.std() > 0.1
    torch.testing.assert_close(tiny(ids, ones), out)


def test_padding_mask_hides_padded_tokens(tiny):
    ids, _ = models.example_inputs(tiny, batch=1, seq_len=10, seed=3)
    mask = torch.ones(1, 10, dtype=torch.long)
    mask[:, 6:] = 0
    padded = tiny(ids, mask)
    alone = tiny(ids[:, :6])
    torch.testing.assert_close(padded[:, :6], alone, atol=ATOL, rtol=0)
    # Without the mask the padded tokens leak into the real ones.
    assert not torch.allclose(tiny(ids)[:, :6], alone, atol=1e-3)


def _hf_name(ours: str) -> str:
    renames = {
        "word_embeddings": "embeddings.word_embeddings",
        "position_embeddings": "embeddings.position_embeddings",
        "token_type_embeddings": "embeddings.token_type_embeddings",
        "embedding_norm": "embeddings.LayerNorm",
        "attention.query": "attention.self.query",
        "attention.key": "attention.self.key",
        "attention.value": "attention.self.value",
        "attention.output": "attention.output.dense",
        "attention_norm": "attention.output.LayerNorm",
        "intermediate": "intermediate.dense",
        "output": "output.dense",
        "output_norm": "output.LayerNorm",
    }
    parts = ours.split(".")
    if parts[0] == "layers":  # layers.3.attention.query.weight
        inner = ".".join(parts[2:-1])
        return f"encoder.layer.{parts[1]}.{renames[inner]}.{parts[-1]}"
    return f"{renames[parts[0]]}.{parts[-1]}"


def test_matches_transformers_bert(tiny):
    transformers = pytest.importorskip("transformers")
    c = tiny.config
    hf_config = transformers.BertConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads, intermediate_size=c.intermediate_size,
        max_position_embeddings=c.max_position, type_vocab_size=c.type_vocab_size, layer_norm_eps=c.layer_norm_eps,
    )
    hf = transformers.BertModel(hf_config, add_pooling_layer=False).eval()
    state = {_hf_name(k): v for k, v in tiny.state_dict().items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("position_ids" in k for k in missing)
    ids, _ = models.example_inputs(tiny, batch=2, seq_len=12, seed=4)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 7:] = 0
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).last_hidden_state
        actual = tiny(ids, mask)
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)
