"""Hugging Face models for ``load``: a ``config.json`` built with seeded random
weights, or a checkpoint directory whose ``*.safetensors`` weights are copied in; pickle
checkpoints are refused (see ``load``'s docstring). Also ``OutputOnly``, the wrapper
that makes a Hugging Face model return one tensor, which the GGUF source uses too."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from graphopt.sources.common import LoadedModel, first_line
from graphopt.sources.model_kind import config_is_causal_lm
from graphopt.errors import ModelLoadError

log = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


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
        attention with no mask, causal, as eager runs it (transformers_attention explains why); otherwise
        nothing. The exported attention then lowers to GroupQueryAttention, not an MHA
        with a materialized causal mask."""
        if not (self.causal and attention_mask is None and torch.compiler.is_exporting()):
            return contextlib.nullcontext()
        from graphopt.sources.transformers_attention import mask_kept, unmasked_sdpa

        return contextlib.nullcontext() if mask_kept(self.model) else unmasked_sdpa(self.model)


def pickle_refusal(path: Path) -> ModelLoadError:
    return ModelLoadError(
        f"{path} holds pickle weights, and graphopt loads only safetensors because unpickling runs "
        "arbitrary code; convert it where you trust it, e.g. model.save_pretrained(dir) writes safetensors"
    )


def import_transformers() -> Any:
    # Imported on demand: it is an optional dependency and takes seconds to import.
    try:
        import transformers
    except ImportError:
        raise ModelLoadError("Hugging Face models need transformers: pip install 'graphopt[hf]'") from None
    return transformers


def read_config(path: Path) -> Any:
    """A ``transformers`` config from ``path``, read without any hub or remote-code lookup."""
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path} ({exc.strerror}); check its permissions") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(
            f"{path} is not valid JSON ({first_line(exc)}); fix it or regenerate it with config.save_pretrained()"
        ) from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise ModelLoadError(f"{path} has no \"model_type\"; a Hugging Face config.json names its model type")
    transformers = import_transformers()
    model_type = raw.pop("model_type")
    try:
        return transformers.AutoConfig.for_model(model_type, **raw)
    except Exception as exc:  # transformers raises ValueError, KeyError or TypeError here
        raise ModelLoadError(
            f"transformers {transformers.__version__} cannot build a {model_type!r} config from {path} "
            f"({first_line(exc)}); upgrade transformers or fix the config"
        ) from None


def hf_model(
    name: str, config: Any, weights: list[Path], seed: int, batch: int, seq_len: int, single: bool,
    dtype: torch.dtype, stream: bool = False,
) -> LoadedModel:
    """``stream``: the weights stay in their files (``safetensors_lazy``) until a runtime writes
    them, one tensor at a time; otherwise they are copied into the model here."""
    transformers = import_transformers()
    if getattr(config, "is_encoder_decoder", False):
        raise ModelLoadError(f"{name} is an encoder-decoder model; graphopt loads decoders and encoders only")
    causal = config_is_causal_lm(config)
    auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
    notes: list[str] = []
    model = _streamed(name, auto, config, weights, dtype, notes) if stream and weights else None
    if model is None:
        try:
            # A private RNG stream: seeded weights without moving the caller's global RNG.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = auto.from_config(config, dtype=dtype)
        except Exception as exc:
            raise ModelLoadError(f"cannot build {name} from its config ({first_line(exc)}); check the config") from None
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
    return LoadedModel(name, module, inputs, "hf-causal-lm" if causal else "hf-encoder", notes)


def _streamed(name: str, auto: Any, config: Any, weights: list[Path], dtype: torch.dtype, notes: list[str]):
    """The model with lazy weights read from ``weights``, or None (with a note saying why) when
    the checkpoint must load in memory, whose errors and warnings then say what is wrong."""
    from graphopt.sources.safetensors_lazy import SafetensorsFormatError, lazy_checkpoint

    try:
        lazy = lazy_checkpoint(auto, config, weights, dtype)
    except SafetensorsFormatError as exc:
        raise ModelLoadError(f"{exc}; re-save the checkpoint") from None
    except ValueError as exc:  # a tensor of another shape than its parameter's
        raise ModelLoadError(first_line(exc)) from None
    except OSError as exc:
        raise ModelLoadError(f"cannot read the weights of {name} ({exc.strerror}); check their permissions") from None
    except Exception as exc:  # a config transformers builds only with real weights
        lazy = f"it cannot be built on empty weights ({first_line(exc)})"
    if isinstance(lazy, str):
        notes.append(f"{name}'s weights load into memory: {lazy}")
        log.warning("graphopt: %s", notes[-1])
        return None
    notes.extend(lazy.notes)
    return lazy.model


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
                    f"{file} is not a readable safetensors file ({first_line(exc)}); re-save the checkpoint"
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
