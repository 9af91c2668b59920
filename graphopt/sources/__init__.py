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
"""

from graphopt.sources.load import LoadedModel, LogitsOnly, OutputOnly, gguf_packages, load_checkpoint, load_model

__all__ = ["LoadedModel", "LogitsOnly", "OutputOnly", "gguf_packages", "load_checkpoint", "load_model"]
