"""``.gguf`` files (llama.cpp's format) for ``load``: transformers reads and
dequantizes them to float weights, with the ``gguf`` and ``accelerate`` packages."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from graphopt.sources.common import LoadedModel, first_line
from graphopt.sources.gguf_cache import load_or_convert, save_dequantized
from graphopt.sources.hf import OutputOnly, import_transformers
from graphopt.errors import ModelLoadError


def gguf_packages() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelLoadError(f"reading a .gguf file needs the packages {' and '.join(missing)}: "
                             f"pip install {' '.join(missing)}")


def from_gguf(path: Path, seed: int, batch: int, seq_len: int, single: bool, dtype: torch.dtype) -> LoadedModel:
    transformers = import_transformers()
    gguf_packages()
    auto = transformers.AutoModelForCausalLM
    try:
        # Converted once, then read from its kept checkpoint folder (graphopt/sources/gguf_cache.py).
        model = load_or_convert(path, "model", dtype,
                                lambda: auto.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype),
                                lambda folder: auto.from_pretrained(folder, dtype=dtype), save_dequantized)
    except Exception as exc:  # an architecture transformers cannot dequantize, a damaged file
        raise ModelLoadError(f"transformers {transformers.__version__} cannot load {path} ({first_line(exc)}); "
                             "check the file, or convert it to a safetensors checkpoint") from None
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=gen)
    module = OutputOnly(model, "logits", True).eval() if single else model
    return LoadedModel(str(path), module, (input_ids,), "hf-causal-lm")
