"""sources.model_kind: one answer to "what kind of model is this" for the step adapters, the ONNX
Runtime decoders and the loaders."""

import pytest
import torch
from torch import nn

from graphopt import models
from graphopt.sources.load import LogitsOnly
from graphopt.sources.model_kind import CAUSAL_LM, ENCODER, EXPLICIT_CACHE, OTHER, is_causal_lm, model_kind

transformers = pytest.importorskip("transformers")


def _tiny(config_cls, model_cls, **extra):
    config = config_cls(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, **extra)
    return model_cls(config).eval()


def test_a_transformers_decoder_is_a_causal_lm():
    model = _tiny(transformers.LlamaConfig, transformers.LlamaForCausalLM, num_key_value_heads=1)
    assert model_kind(model) == CAUSAL_LM and is_causal_lm(model)


def test_a_transformers_encoder_is_an_encoder_even_when_forward_names_a_cache():
    model = _tiny(transformers.BertConfig, transformers.BertModel)
    assert model_kind(model) == ENCODER and not is_causal_lm(model)


def test_the_built_in_llama_has_an_explicit_cache_and_its_logits_only_wrapper_has_none():
    llama = models.build("llama-tiny")
    assert model_kind(llama) == EXPLICIT_CACHE
    assert model_kind(LogitsOnly(llama)) == OTHER


def test_a_plain_module_is_other():
    assert model_kind(nn.Linear(2, 2)) == OTHER
    assert model_kind(torch.relu) == OTHER  # no forward, no signature
