"""Turn the model argument of a CLI command into a module and inputs to run it on.

A spec is one of:
- a built-in name (``llama-tiny``, ``bert-small``, ...; see ``graphopt.models``);
- a Hugging Face ``config.json``, or a directory holding one and no weights: the model is
  built from the config with seeded random weights, which is all a compiler needs to show
  what its passes do;
- a checkpoint directory with ``config.json`` and ``*.safetensors`` weights;
- a ``.gguf`` file (llama.cpp's format): transformers reads and dequantizes it to float
  weights, with the ``gguf`` and ``accelerate`` packages;
- ``package.module:factory``, a callable returning a module or ``(module, example_inputs)``.

Weights load from safetensors only. ``.bin``/``.pt`` checkpoints are pickles, and unpickling
runs whatever code the file carries; a compiler CLI that people point at downloaded
directories must not do that, so such a directory is refused with the command that converts it.

Every failure is a ``ModelLoadError`` with one line that says what to fix. The returned module
gives one tensor per call wherever graphopt knows the model (logits, or the last hidden
state), so the commands that compare against eager compare one tensor.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import json
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from graphopt import models
from graphopt.errors import ModelLoadError

log = logging.getLogger(__name__)

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass
class LoadedModel:
    """A model ready to compile: ``module(*example_inputs)`` runs it once."""

    name: str
    module: nn.Module
    example_inputs: tuple
    family: str  # "llama" | "bert" | "hf-causal-lm" | "hf-encoder" | "custom"


class LogitsOnly(nn.Module):
    """A built-in Llama that returns the logits and drops the KV cache it also returns."""

    def __init__(self, model: models.LlamaForCausalLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids)[0]


class OutputOnly(nn.Module):
    """A Hugging Face model that returns one tensor field of its output (``logits`` or
    ``last_hidden_state``), called without a cache so the graph has no cache object in it."""

    def __init__(self, model: nn.Module, field: str, causal: bool) -> None:
        super().__init__()
        self.model, self.field, self.causal = model, field, causal

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        extra = {"use_cache": False} if self.causal else {}
        with self._export_context(attention_mask):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=True, **extra)
        return getattr(out, self.field)

    def _export_context(self, attention_mask: Tensor | None):
        """While torch.export traces a causal LM without a padding mask: transformers' sdpa
        attention with no mask, causal, as eager runs it (hf_steps explains why); otherwise
        nothing. The exported attention then lowers to GroupQueryAttention, not an MHA
        with a materialized causal mask."""
        if not (self.causal and attention_mask is None and torch.compiler.is_exporting()):
            return contextlib.nullcontext()
        from graphopt.backends.onnxruntime.hf_steps import mask_kept, unmasked_sdpa

        return contextlib.nullcontext() if mask_kept(self.model) else unmasked_sdpa(self.model)


def load_model(
    spec: str,
    seed: int = 0,
    *,
    batch: int = 1,
    seq_len: int = 16,
    single_output: bool = True,
    dtype: torch.dtype = torch.float32,
) -> LoadedModel:
    """Load ``spec`` in eval mode on the CPU, with inputs of ``batch`` x ``seq_len`` tokens.

    ``dtype`` applies to built-in and Hugging Face models whatever dtype a config names:
    float32 by default, because numeric checks against eager need the headroom.
    ``single_output=False`` keeps the raw module (a built-in Llama then also returns its cache,
    a Hugging Face model its output object). A factory's module is used as it comes.
    """
    if batch < 1 or seq_len < 1:
        raise ModelLoadError(f"batch ({batch}) and seq_len ({seq_len}) must be at least 1")
    if spec in models.names():
        return _builtin(spec, seed, batch, seq_len, single_output, dtype)
    path = Path(spec).expanduser()
    if path.exists():
        return _from_path(path, seed, batch, seq_len, single_output, dtype)
    if ":" in spec and not _looks_like_path(spec):
        return _from_factory(spec, seed, batch, seq_len)
    if _looks_like_path(spec):
        raise ModelLoadError(f"no such file or directory: {spec}; check the path")
    raise ModelLoadError(
        f"unknown model {spec!r}: use a built-in name ({', '.join(models.names())}), "
        "a config.json path, a safetensors checkpoint directory, or package.module:factory"
    )


def _looks_like_path(spec: str) -> bool:
    return os.sep in spec or "/" in spec or spec.endswith(".json") or spec.startswith((".", "~"))


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _builtin(name: str, seed: int, batch: int, seq_len: int, single: bool, dtype: torch.dtype) -> LoadedModel:
    model = models.build(name, seed).to(dtype)
    try:
        inputs = models.example_inputs(model, batch=batch, seq_len=seq_len, seed=seed)
    except ValueError as exc:
        raise ModelLoadError(f"{name}: {exc}; pass a shorter sequence") from None
    family = "llama" if isinstance(model, models.LlamaForCausalLM) else "bert"
    module = LogitsOnly(model) if single and family == "llama" else model
    return LoadedModel(name, module.eval(), inputs, family)


# --- Hugging Face configs and checkpoints -------------------------------------------------


def _from_path(path: Path, seed: int, batch: int, seq_len: int, single: bool, dtype: torch.dtype) -> LoadedModel:
    if path.is_file():
        if path.suffix == ".gguf":
            return _from_gguf(path, seed, batch, seq_len, single, dtype)
        if path.suffix == ".json":
            config = _read_config(path)
            return _hf_model(str(path), config, [], seed, batch, seq_len, single, dtype)
        if path.suffix == ".safetensors":
            raise ModelLoadError(f"{path} is a weights file; pass the directory that holds it and its config.json")
        if path.suffix in _PICKLE_SUFFIXES:
            raise _pickle_refusal(path)
        raise ModelLoadError(f"{path} is not a config.json, a .gguf file or a checkpoint directory; pass one of those")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{path} has no config.json; pass a Hugging Face checkpoint directory")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        pickles = sorted(p for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        if pickles:
            raise _pickle_refusal(pickles[0])
        log.warning("%s has no weight files; building it with seeded random weights", path)
    config = _read_config(config_path)
    return _hf_model(str(path), config, weights, seed, batch, seq_len, single, dtype)


def gguf_packages() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelLoadError(f"reading a .gguf file needs the packages {' and '.join(missing)}: "
                             f"pip install {' '.join(missing)}")


def _from_gguf(path: Path, seed: int, batch: int, seq_len: int, single: bool, dtype: torch.dtype) -> LoadedModel:
    transformers = _transformers()
    gguf_packages()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    except Exception as exc:  # an architecture transformers cannot dequantize, a damaged file
        raise ModelLoadError(f"transformers {transformers.__version__} cannot load {path} ({_first_line(exc)}); "
                             "check the file, or convert it to a safetensors checkpoint") from None
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=gen)
    module = OutputOnly(model, "logits", True).eval() if single else model
    return LoadedModel(str(path), module, (input_ids,), "hf-causal-lm")


def _pickle_refusal(path: Path) -> ModelLoadError:
    return ModelLoadError(
        f"{path} holds pickle weights, and graphopt loads only safetensors because unpickling runs "
        "arbitrary code; convert it where you trust it, e.g. model.save_pretrained(dir) writes safetensors"
    )


def _transformers() -> Any:
    # Imported on demand: it is an optional dependency and takes seconds to import.
    try:
        import transformers
    except ImportError:
        raise ModelLoadError("Hugging Face models need transformers: pip install 'graphopt[hf]'") from None
    return transformers


def _read_config(path: Path) -> Any:
    """A ``transformers`` config from ``path``, read without any hub or remote-code lookup."""
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path} ({exc.strerror}); check its permissions") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(
            f"{path} is not valid JSON ({_first_line(exc)}); fix it or regenerate it with config.save_pretrained()"
        ) from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise ModelLoadError(f"{path} has no \"model_type\"; a Hugging Face config.json names its model type")
    transformers = _transformers()
    model_type = raw.pop("model_type")
    try:
        return transformers.AutoConfig.for_model(model_type, **raw)
    except Exception as exc:  # transformers raises ValueError, KeyError or TypeError here
        raise ModelLoadError(
            f"transformers {transformers.__version__} cannot build a {model_type!r} config from {path} "
            f"({_first_line(exc)}); upgrade transformers or fix the config"
        ) from None


def _is_causal(transformers: Any, config: Any) -> bool:
    architectures = getattr(config, "architectures", None) or []
    if architectures:
        return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures)
    # No architectures field: a type with a causal LM head and no masked-LM head is a decoder
    # (Llama, GPT-2); BERT-like types have both and are treated as encoders.
    kind = type(config)
    return kind in transformers.MODEL_FOR_CAUSAL_LM_MAPPING and kind not in transformers.MODEL_FOR_MASKED_LM_MAPPING


def _hf_model(
    name: str, config: Any, weights: list[Path], seed: int, batch: int, seq_len: int, single: bool,
    dtype: torch.dtype,
) -> LoadedModel:
    transformers = _transformers()
    if getattr(config, "is_encoder_decoder", False):
        raise ModelLoadError(f"{name} is an encoder-decoder model; graphopt loads decoders and encoders only")
    causal = _is_causal(transformers, config)
    auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
    try:
        # A private RNG stream: seeded weights without moving the caller's global RNG.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = auto.from_config(config, dtype=dtype)
    except Exception as exc:
        raise ModelLoadError(f"cannot build {name} from its config ({_first_line(exc)}); check the config") from None
    if weights:
        _load_safetensors(model, weights)
    model.eval()
    max_len = getattr(config, "max_position_embeddings", None)
    if max_len is not None and seq_len > max_len:
        raise ModelLoadError(f"seq_len {seq_len} exceeds {name}'s max_position_embeddings {max_len}")
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=gen)
    inputs = (input_ids,) if causal else (input_ids, torch.ones(batch, seq_len, dtype=torch.long))
    field = "logits" if causal else "last_hidden_state"
    module = OutputOnly(model, field, causal).eval() if single else model
    return LoadedModel(name, module, inputs, "hf-causal-lm" if causal else "hf-encoder")


def _load_safetensors(model: nn.Module, files: list[Path]) -> None:
    """Copy tensors from ``files`` into ``model`` one at a time (peak memory: one tensor)."""
    from safetensors import safe_open

    targets = model.state_dict()  # detached views of the parameters: copy_ writes through
    prefix = getattr(model, "base_model_prefix", "")
    loaded: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as handle:
                    for key in handle.keys():
                        # A task-head checkpoint (bert.embeddings...) loaded into a base model.
                        target = key
                        if key not in targets and prefix and key.startswith(prefix + "."):
                            target = key[len(prefix) + 1 :]
                        if target not in targets:
                            unexpected.append(key)
                            continue
                        tensor = handle.get_tensor(key)
                        if tensor.shape != targets[target].shape:
                            raise ModelLoadError(
                                f"{file.name}: {key} has shape {tuple(tensor.shape)}, the config says "
                                f"{tuple(targets[target].shape)}; the weights do not belong to this config.json"
                            )
                        targets[target].copy_(tensor)
                        loaded.add(target)
            except ModelLoadError:
                raise
            except Exception as exc:  # safetensors raises SafetensorError, OSError, ...
                raise ModelLoadError(
                    f"{file} is not a readable safetensors file ({_first_line(exc)}); re-save the checkpoint"
                ) from None
    missing = _missing(targets, loaded)
    # A task-head checkpoint has no pooler, and the last hidden state never reads it.
    pooler = [k for k in missing if k.startswith("pooler.")]
    if pooler:
        log.warning("the checkpoint has no pooler weights; pooler_output is random")
        missing = [k for k in missing if k not in pooler]
    if missing:
        raise ModelLoadError(
            f"the checkpoint lacks {len(missing)} weights the config needs (first: {missing[0]}); "
            "check it is complete and matches config.json"
        )
    if unexpected:
        log.warning(
            "ignored %d checkpoint tensors the model has no place for (first: %s)", len(unexpected), unexpected[0]
        )


def _missing(targets: dict[str, Tensor], loaded: set[str]) -> list[str]:
    """Keys neither loaded nor tied to a loaded key (a tied lm_head is saved only once)."""
    loaded_storage = {targets[k].untyped_storage().data_ptr() for k in loaded}
    return [k for k in targets if k not in loaded and targets[k].untyped_storage().data_ptr() not in loaded_storage]


# --- package.module:factory ---------------------------------------------------------------


@contextlib.contextmanager
def _cwd_importable() -> Iterator[None]:
    # A console script's sys.path starts at its own bin/ directory, so `mymodels:make` next
    # to the user would not import without this.
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added:
            sys.path.remove(cwd)


def _from_factory(spec: str, seed: int, batch: int, seq_len: int) -> LoadedModel:
    module_name, _, attr = spec.partition(":")
    if not all(p.isidentifier() for p in module_name.split(".")) or not all(p.isidentifier() for p in attr.split(".")):
        raise ModelLoadError(f"factory spec {spec!r} must look like package.module:function")
    try:
        with _cwd_importable():
            target: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise ModelLoadError(
            f"cannot import {module_name!r} for {spec!r} ({type(exc).__name__}: {_first_line(exc)}); "
            "make it importable from the current directory or PYTHONPATH"
        ) from None
    for part in attr.split("."):
        target = getattr(target, part, None)
    if not callable(target):
        raise ModelLoadError(f"{module_name} has no callable {attr!r}; check the name after the colon in {spec!r}")
    try:
        takes_seed = "seed" in inspect.signature(target).parameters
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        takes_seed = False
    try:
        result = target(seed=seed) if takes_seed else target()
    except Exception as exc:
        raise ModelLoadError(
            f"factory {spec} raised {type(exc).__name__}: {_first_line(exc)}; fix the factory"
        ) from None
    module, inputs = result if isinstance(result, tuple) and len(result) == 2 else (result, None)
    if not isinstance(module, nn.Module):
        raise ModelLoadError(
            f"factory {spec} returned {type(result).__name__}; return an nn.Module or (module, example_inputs)"
        )
    if inputs is None:
        inputs = _inputs_for_module(spec, module, batch, seq_len, seed)
    elif isinstance(inputs, Tensor):
        inputs = (inputs,)
    elif isinstance(inputs, list):
        inputs = tuple(inputs)
    elif not isinstance(inputs, tuple):
        raise ModelLoadError(f"factory {spec} returned example inputs of type {type(inputs).__name__}; return a tuple")
    return LoadedModel(spec, module.eval(), inputs, "custom")


def _inputs_for_module(spec: str, module: nn.Module, batch: int, seq_len: int, seed: int) -> tuple:
    """Example inputs for a factory's module when it gave none and its kind says what they are."""
    if isinstance(module, (models.LlamaForCausalLM, models.BertModel)):
        return models.example_inputs(module, batch=batch, seq_len=seq_len, seed=seed)
    vocab = getattr(getattr(module, "config", None), "vocab_size", None)
    if isinstance(vocab, int):
        gen = torch.Generator().manual_seed(seed)
        return (torch.randint(0, vocab, (batch, seq_len), generator=gen),)
    raise ModelLoadError(
        f"factory {spec} returned a {type(module).__name__} without example inputs; return (module, example_inputs)"
    )
