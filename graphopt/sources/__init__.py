"""Model and tokenizer loading: a spec (a built-in name, a Hugging Face config or checkpoint,
a ``.gguf`` file, ``package.module:factory``) -> a module and inputs to run it on.

- ``load``: ``load_model``, the dispatch on the spec, and the built-in models.
- ``hf``: Hugging Face ``config.json`` (seeded random weights) and safetensors checkpoints;
  ``OutputOnly``, a model that returns one tensor.
- ``gguf``: ``.gguf`` files (llama.cpp's format), read through transformers.
- ``gguf_cache``: a ``.gguf`` converted once, kept as a checkpoint folder that loads in a second.
- ``factory``: ``package.module:factory`` specs.
- ``common``: ``LoadedModel``, what every source returns, and the one-line error text.
- ``tokenizers``: the tokenizer that ships with a model, and SmolLM2's GGUF file.
- ``gguf_file``: a ``.gguf`` file read in place: its metadata, and each tensor's bytes as stored.
- ``gguf_blocks``: llama.cpp's quantized blocks re-laid out as graphopt's block format, value for value.
- ``gguf_lazy``: a ``.gguf`` file as a transformers model whose weights stay in the file until a
  runtime asks.
- ``checkpoints``: a model file as a ``Checkpoint`` before anything is built (``load_checkpoint``); no torch.
- ``transformers_attention``: transformers' sdpa attention traced without a mask where eager runs
  none (``mask_kept``, ``unmasked_sdpa``), for exports of any target.
- ``gguf_needs``: what reading a ``.gguf`` needs (its packages, the memory it will take); no torch.
- ``safetensors_file``: a checkpoint directory's ``*.safetensors`` headers, identity and size; no torch.
- ``safetensors_lazy``: a safetensors checkpoint as a transformers model whose weights stay in
  the files until a runtime writes them, one tensor at a time.
- ``model_kind``: what kind of model a module is (a transformers causal LM, a module with an
  explicit cache like the built-in Llama, an encoder), decided once for every caller; no torch.

The names below load on first use, so that ``load_checkpoint`` and ``tokenizers`` cost no torch.
"""

import importlib
from typing import Any

__all__ = ["LoadedModel", "LogitsOnly", "OutputOnly", "gguf_packages", "load_checkpoint", "load_model"]

_WHERE = {"LoadedModel": "common", "LogitsOnly": "load", "OutputOnly": "hf", "gguf_packages": "gguf_needs",
          "load_checkpoint": "checkpoints", "load_model": "load"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'graphopt.sources' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"graphopt.sources.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
