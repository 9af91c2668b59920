"""Turn the model argument of a CLI command into a module and inputs to run it on.

A spec is one of:
- a built-in name (``llama-tiny``, ``bert-small``, ...; see ``graphopt.models``);
- a Hugging Face ``config.json``, or a directory holding one and no weights: the model is
  built from the config with seeded random weights, which is all a compiler needs to show
  what its passes do;
- a checkpoint directory with ``config.json`` and ``*.safetensors`` weights (with
  ``stream_weights=True`` they stay in their files until a runtime writes them, one tensor at
  a time: ``safetensors_lazy.py``);
- a ``.gguf`` file (llama.cpp's format): by default the model runs on the file's own
  (quantized) weights, read when a runtime needs them; ``gguf_weights="dequantize"`` reads it
  transformers' way, dequantized to float (``gguf.py``);
- ``package.module:factory``, a callable returning a module or ``(module, example_inputs)``.

Weights load from safetensors only. ``.bin``/``.pt`` checkpoints are pickles, and unpickling
runs whatever code the file carries; a compiler CLI that people point at downloaded
directories must not do that, so such a directory is refused with the command that converts it.

Every failure is a ``ModelLoadError`` with one line that says what to fix. The returned module
gives one tensor per call wherever graphopt knows the model (logits, or the last hidden
state), so the commands that compare against eager compare one tensor.

Built-in names and the dispatch are here; each other kind loads in its own module:
``hf`` (config.json, checkpoint directory), ``gguf``, ``factory``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch import Tensor, nn

from graphopt import models
from graphopt.sources.common import LoadedModel
from graphopt.sources.factory import from_factory
from graphopt.sources.checkpoints import load_checkpoint  # noqa: F401  (re-exported)
from graphopt.sources.gguf_needs import gguf_packages  # noqa: F401  (re-exported)
from graphopt.sources.gguf import from_gguf
from graphopt.sources.hf import PICKLE_SUFFIXES, OutputOnly, hf_model, pickle_refusal, read_config
from graphopt.errors import ModelLoadError

# Callers import these from here whichever module loads the kind of model they name.
__all__ = ["LoadedModel", "LogitsOnly", "OutputOnly", "gguf_packages", "load_checkpoint", "load_model"]

log = logging.getLogger(__name__)


class LogitsOnly(nn.Module):
    """A built-in Llama that returns the logits and drops the KV cache it also returns."""

    def __init__(self, model: models.LlamaForCausalLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids)[0]


def load_model(
    spec: str,
    seed: int = 0,
    *,
    batch: int = 1,
    seq_len: int = 16,
    single_output: bool = True,
    dtype: torch.dtype = torch.float32,
    gguf_weights: str = "file",
    stream_weights: bool = False,
) -> LoadedModel:
    """Load ``spec`` in eval mode on the CPU, with inputs of ``batch`` x ``seq_len`` tokens.

    ``dtype`` applies to built-in and Hugging Face models whatever dtype a config names:
    float32 by default, because numeric checks against eager need the headroom.
    ``single_output=False`` keeps the raw module (a built-in Llama then also returns its cache,
    a Hugging Face model its output object). A factory's module is used as it comes.
    ``gguf_weights``: "file" (a .gguf's own weights, left in the file until a runtime reads
    them) or "dequantize" (transformers' float model).
    ``stream_weights``: a safetensors checkpoint's weights stay in its files (lazy, as a .gguf's
    do) for a runtime that writes them itself (the ONNX exporter); the module then runs eagerly
    only after ``graphopt.lazy_weights.materialize_module``.
    """
    if batch < 1 or seq_len < 1:
        raise ModelLoadError(f"batch ({batch}) and seq_len ({seq_len}) must be at least 1")
    if spec in models.names():
        return _builtin(spec, seed, batch, seq_len, single_output, dtype)
    path = Path(spec).expanduser()
    if path.exists():
        return _from_path(path, seed, batch, seq_len, single_output, dtype, gguf_weights, stream_weights)
    if ":" in spec and not _looks_like_path(spec):
        return from_factory(spec, seed, batch, seq_len)
    if _looks_like_path(spec):
        raise ModelLoadError(f"no such file or directory: {spec}; check the path")
    raise ModelLoadError(
        f"unknown model {spec!r}: use a built-in name ({', '.join(models.names())}), "
        "a config.json path, a safetensors checkpoint directory, or package.module:factory"
    )


def _looks_like_path(spec: str) -> bool:
    return os.sep in spec or "/" in spec or spec.endswith(".json") or spec.startswith((".", "~"))


def _builtin(name: str, seed: int, batch: int, seq_len: int, single: bool, dtype: torch.dtype) -> LoadedModel:
    model = models.build(name, seed).to(dtype)
    try:
        inputs = models.example_inputs(model, batch=batch, seq_len=seq_len, seed=seed)
    except ValueError as exc:
        raise ModelLoadError(f"{name}: {exc}; pass a shorter sequence") from None
    family = "llama" if isinstance(model, models.LlamaForCausalLM) else "bert"
    module = LogitsOnly(model) if single and family == "llama" else model
    return LoadedModel(name, module.eval(), inputs, family)


# --- a path: a config.json, a checkpoint directory or a .gguf file --------------------------


def _from_path(path: Path, seed: int, batch: int, seq_len: int, single: bool, dtype: torch.dtype,
               gguf_weights: str = "file", stream: bool = False) -> LoadedModel:
    if path.is_file():
        if path.suffix == ".gguf":
            return from_gguf(path, seed, batch, seq_len, single, dtype, gguf_weights)
        if path.suffix == ".json":
            config = read_config(path)
            return hf_model(str(path), config, [], seed, batch, seq_len, single, dtype)
        if path.suffix == ".safetensors":
            raise ModelLoadError(f"{path} is a weights file; pass the directory that holds it and its config.json")
        if path.suffix in PICKLE_SUFFIXES:
            raise pickle_refusal(path)
        raise ModelLoadError(f"{path} is not a config.json, a .gguf file or a checkpoint directory; pass one of those")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{path} has no config.json; pass a Hugging Face checkpoint directory")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        pickles = sorted(p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise pickle_refusal(pickles[0])
        log.warning("%s has no weight files; building it with seeded random weights", path)
    config = read_config(config_path)
    return hf_model(str(path), config, weights, seed, batch, seq_len, single, dtype, stream)
