"""``.gguf`` files (llama.cpp's format) for ``load``.

By default (``weights="file"``) the model runs on the file's own weights: a transformers
model whose parameters stay in the file (``gguf_lazy``), quantized ones as the blocks they
are, read one tensor at a time when a runtime writes its weights. ``weights="dequantize"``
is transformers' own reading instead: every tensor dequantized to float in memory (kept as a
checkpoint folder for the next run, ``gguf_cache``). An architecture ``gguf_lazy`` does not
map falls back to that, with a warning. Both need the ``gguf`` and ``accelerate`` packages.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import torch

from graphopt.errors import ModelLoadError
from graphopt.sources.gguf_needs import check_memory, gguf_packages
from graphopt.sources.common import LoadedModel, first_line
from graphopt.sources.gguf_cache import load_or_convert, save_dequantized
from graphopt.sources.gguf_file import GGUFFormatError
from graphopt.sources.gguf_lazy import lazy_model
from graphopt.sources.hf import OutputOnly, import_transformers

log = logging.getLogger("graphopt")


WEIGHTS = ("file", "dequantize")


def from_gguf(path: Path, seed: int, batch: int, seq_len: int, single: bool, dtype: torch.dtype,
              weights: str = "file") -> LoadedModel:
    if weights not in WEIGHTS:
        raise ModelLoadError(f"unknown GGUF weights {weights!r}; choose one of: {', '.join(WEIGHTS)}")
    transformers = import_transformers()
    gguf_packages()
    check_memory(path, weights)
    notes: list[str] = []
    if weights == "file":
        try:
            lazy = lazy_model(path, dtype)
            return _loaded(path, lazy.model, seed, batch, seq_len, single, lazy.notes)
        except GGUFFormatError as exc:
            raise ModelLoadError(f"{exc}; check the file (a download cut short?)") from None
        except NotImplementedError as exc:  # an architecture gguf_lazy does not map: transformers' way
            notes.append(f"{path.name} runs dequantized to float (transformers' reading): {exc} is not mapped "
                         "to run on the file's own weights")
            log.warning("graphopt: %s", notes[-1])
        except ValueError as exc:
            raise ModelLoadError(f"cannot load {path}: {first_line(exc)}") from None
    auto = transformers.AutoModelForCausalLM
    try:
        # Converted once, then read from its kept checkpoint folder (graphopt/sources/gguf_cache.py).
        model = load_or_convert(path, "model", dtype,
                                lambda: auto.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype),
                                lambda folder: auto.from_pretrained(folder, dtype=dtype), save_dequantized)
    except Exception as exc:  # an architecture transformers cannot dequantize, a damaged file
        raise ModelLoadError(f"transformers {transformers.__version__} cannot load {path} ({first_line(exc)}); "
                             "check the file, or convert it to a safetensors checkpoint") from None
    return _loaded(path, model, seed, batch, seq_len, single, notes)


def _loaded(path: Path, model, seed: int, batch: int, seq_len: int, single: bool, notes: list[str]) -> LoadedModel:
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=gen)
    module = OutputOnly(model, "logits", True).eval() if single else model
    return LoadedModel(str(path), module, (input_ids,), "hf-causal-lm", list(notes))
