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

from graphopt.sources.common import LoadedModel, first_line
from graphopt.sources.gguf_cache import load_or_convert, save_dequantized
from graphopt.sources.hf import OutputOnly, import_transformers
from graphopt.errors import ModelLoadError
from graphopt.generation.checkpoint import Checkpoint
from graphopt.sources.gguf_file import GGUFFormatError, file_identity
from graphopt.sources.gguf_lazy import lazy_model

log = logging.getLogger("graphopt")


def gguf_packages() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelLoadError(f"reading a .gguf file needs the packages {' and '.join(missing)}: "
                             f"pip install {' '.join(missing)}")


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


def needed_bytes(path: Path, weights: str) -> tuple[int, list[tuple[str, int]]]:
    """(bytes a decoding process needs for the file read as ``weights``, alternatives that
    need less): the weights as the runtime holds them (blocks re-laid out, widened where
    MatMulNBits has no kernel of their width; float32 where dequantized, twice over for
    transformers' float model and the runtime's copy of it) and the runtime's own share."""
    from graphopt.memory import RUNTIME_BYTES
    from graphopt.sources.gguf_file import GGUFFile
    from graphopt.sources.gguf_lazy import FORMATS

    try:
        file = GGUFFile(path)
    except GGUFFormatError as exc:
        raise ModelLoadError(f"{exc}; check the file (a download cut short?)") from None
    own = dense = 0
    for info in file.tensors.values():
        elements = 1
        for d in info.shape:
            elements *= d
        fmt = FORMATS.get(info.type)
        own += int(elements * fmt.bytes_per_weight()) if fmt is not None else elements * 4
        dense += elements * 4
    own, dense = own + RUNTIME_BYTES, 2 * dense + RUNTIME_BYTES
    if weights == "file":
        return own, []
    return dense, [("on the file's own quantized weights (without --dequantize)", own)]


def check_memory(path: Path, weights: str) -> None:
    """MemoryNeeded, in one line, when the file read as ``weights`` would not fit."""
    from graphopt.memory import check_fits

    needed, alternatives = needed_bytes(path, weights)
    how = "its own quantized weights" if weights == "file" else "its weights dequantized to float32"
    check_fits(needed, f"{path.name} on {how}", alternatives)


def gguf_checkpoint(path: Path, dtype: torch.dtype = torch.float32) -> Checkpoint:
    """The file as a ``Checkpoint`` (graphopt.generate decodes it without building the model when
    a runner kept from an earlier run serves it); ``build()`` makes the lazy model."""
    gguf_packages()
    try:
        identity = f"gguf;{file_identity(path)};{dtype}"
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc.strerror}") from None
    return Checkpoint(identity, lambda: from_gguf(path, 0, 1, 1, False, dtype).module, str(path),
                      check_memory=lambda: check_memory(path, "file"))


def _loaded(path: Path, model, seed: int, batch: int, seq_len: int, single: bool, notes: list[str]) -> LoadedModel:
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=gen)
    module = OutputOnly(model, "logits", True).eval() if single else model
    return LoadedModel(str(path), module, (input_ids,), "hf-causal-lm", list(notes))
