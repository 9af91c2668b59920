"""The fusion catalogue's acceptance test: the default pipeline on transformers models."""

import pytest
import torch

from tests.helpers import assert_matches_eager, compile_with_graphopt, count, eager

transformers = pytest.importorskip("transformers")


class LlamaLogits(torch.nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
        self.model = transformers.LlamaForCausalLM(config).eval()

    def forward(self, ids):
        return self.model(ids, use_cache=False).logits


@pytest.mark.parametrize("layers", [2, 3])
def test_llama_fuses_every_layer(layers):
    torch.manual_seed(0)
    model = LlamaLogits(layers)
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(1))
    out, report = compile_with_graphopt(model, ids)
    assert count(report, "graphopt.rms_norm") + count(report, "graphopt.add_rms_norm") == 2 * layers + 1
    assert count(report, "graphopt.swiglu") == layers
    assert count(report, "graphopt.qkv_proj") == layers
    assert count(report, "graphopt.attention") == layers
    assert count(report, "graphopt.rope") in (layers, 2 * layers)  # q and k rotate apart
    assert count(report, "aten._scaled_dot_product_flash_attention_for_cpu") == 0
    assert_matches_eager(out, eager(model, ids), rel=1e-5)


def test_bert_fuses_layer_norm_gelu_and_attention_on_every_layer():
    torch.manual_seed(0)
    layers = 2
    config = transformers.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                     num_attention_heads=4, vocab_size=128)
    bert = transformers.BertModel(config).eval()

    class Hidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, ids, mask):
            return self.bert(ids, attention_mask=mask).last_hidden_state

    model = Hidden()
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    out, report = compile_with_graphopt(model, ids, mask)
    # Two residual LayerNorms per layer, plus the embedding LayerNorm (its add broadcasts).
    assert count(report, "graphopt.add_layer_norm") == 2 * layers
    assert count(report, "graphopt.layer_norm") == 1
    assert count(report, "aten.native_layer_norm") == 0
    assert count(report, "graphopt.bias_gelu") == layers and count(report, "aten.gelu") == 0
    assert count(report, "graphopt.attention") == layers
    assert_matches_eager(out, eager(model, ids, mask), rel=1e-5)
