"""A .gguf file as a transformers model with lazy weights: the config transformers derives, and
every parameter, read on demand, equal to what transformers loads (dequantized), its blocks
equal to it too, including Llama's q/k rows that llama.cpp's converter permuted."""

import pytest
import torch

from graphopt import lazy_weights
from graphopt.sources.gguf_file import GGUFFile
from graphopt.sources.gguf_lazy import gguf_config, gguf_tokenizer, lazy_model
from tests.models.gguf_helpers import T, transformers_model, write_tiny

TYPES = {"attn_q": T.Q4_0, "attn_k": T.Q5_1, "attn_v": T.Q8_0, "ffn_gate": T.Q4_1, "ffn_up": T.Q5_0,
         "token_embd": T.Q8_0, "output": T.Q5_1}
DOWN = {"llama": T.Q6_K, "qwen2": T.Q4_K}  # K-quants need rows of 256: only ffn_down has them here


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "tiny.gguf"
    return write_tiny(path, request.param, {**TYPES, "ffn_down": DOWN[request.param]}, tied=request.param == "llama")


def test_config_is_transformers_own(tiny):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    assert gguf_config(GGUFFile(tiny)) == load_gguf_checkpoint(str(tiny), return_tensors=False)["config"]


def test_every_parameter_reads_as_transformers_loads_it(tiny):
    lazy, reference = lazy_model(tiny), transformers_model(tiny)
    assert lazy.notes == [] and lazy.dequantized == {}
    expected = dict(reference.named_parameters())
    params = dict(lazy.model.named_parameters())
    assert set(params) == set(expected)
    for name, param in params.items():
        assert lazy_weights.is_lazy(param), name
        source = lazy_weights.source_of(param)
        assert torch.equal(source.load(), expected[name]), name
        if lazy_weights.block_format(source) is not None:  # the blocks hold the same values
            assert torch.equal(torch.from_numpy(source.block_quantized().dequantize()), expected[name]), name


def test_tied_head_is_the_table(tiny):
    model = lazy_model(tiny).model
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == model.config.tie_word_embeddings


def test_a_type_without_a_kernel_is_read_as_floats_and_said(tmp_path):
    path = write_tiny(tmp_path / "q3.gguf", "llama", {"ffn_down": T.Q3_K})
    lazy = lazy_model(path)
    assert lazy.notes == ["3 quantized tensors (Q3_K) run dequantized: Q3_K has no kernel here"]
    down = lazy.model.model.layers[0].mlp.down_proj.weight
    assert lazy_weights.block_format(lazy_weights.source_of(down)) is None


def test_an_unmapped_architecture_is_refused(tmp_path):
    path = write_tiny(tmp_path / "t5.gguf", "t5")
    with pytest.raises(NotImplementedError, match="t5"):
        lazy_model(path)


def test_tokenizer_is_transformers_own(tiny):
    import transformers

    ours = gguf_tokenizer(GGUFFile(tiny), lazy_model(tiny).model.config.model_type)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tiny.parent), gguf_file=tiny.name)
    assert type(ours) is type(theirs)
    for text in ("t1t2 t3", "t9t0t", "tt7"):
        assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    assert (ours.bos_token, ours.eos_token) == (theirs.bos_token, theirs.eos_token)
