"""What kind of model a module is, decided in one place.

- ``CAUSAL_LM``: a transformers decoder-only model that generates from a cache of its own
  (Llama, Qwen2, GPT-2; not an encoder-decoder).
- ``EXPLICIT_CACHE``: a module whose ``forward(input_ids, past_key_values=None, ...)`` returns
  ``(logits, ((k, v), ...))``, as graphopt's built-in Llama does: its cache is plain tensors.
- ``ENCODER``: anything else transformers made (BERT-like models that do not generate, an
  encoder-decoder), whose ``forward`` may still name a ``past_key_values``.
- ``OTHER``: a module graphopt knows nothing about (it still compiles; it does not decode).

The generation step adapters, the ONNX Runtime decoders and the loaders all ask here, so a
model is never a causal LM to one and an encoder to another. Imports no torch.
"""

from __future__ import annotations

import inspect
from typing import Any

CAUSAL_LM = "causal_lm"
EXPLICIT_CACHE = "explicit_cache"
ENCODER = "encoder"
OTHER = "other"


def _from_transformers(model: Any) -> bool:
    return type(model).__module__.startswith("transformers.")


def model_kind(model: Any) -> str:
    """``CAUSAL_LM``, ``EXPLICIT_CACHE``, ``ENCODER`` or ``OTHER`` (module docstring)."""
    if _from_transformers(model):
        config = getattr(model, "config", None)
        if hasattr(model, "generate") and not getattr(config, "is_encoder_decoder", False):
            return CAUSAL_LM
        return ENCODER
    forward = getattr(model, "forward", None)
    try:
        takes_cache = forward is not None and "past_key_values" in inspect.signature(forward).parameters
    except (TypeError, ValueError):  # a builtin or C callable has no signature
        takes_cache = False
    return EXPLICIT_CACHE if takes_cache else OTHER


def config_is_causal_lm(config: Any) -> bool:
    """Whether a transformers config describes a ``CAUSAL_LM`` (before any module exists: which
    class the loaders build). Its ``architectures`` say so; without them, a model type with a
    causal LM head and no masked-LM head is a decoder (Llama, GPT-2), while BERT-like types have
    both and are encoders."""
    import transformers

    architectures = getattr(config, "architectures", None) or []
    if architectures:
        return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures)
    kind = type(config)
    return kind in transformers.MODEL_FOR_CAUSAL_LM_MAPPING and kind not in transformers.MODEL_FOR_MASKED_LM_MAPPING


def decodes(model: Any) -> bool:
    """A model graphopt.generate decodes: a transformers causal LM or an explicit-cache module."""
    return model_kind(model) in (CAUSAL_LM, EXPLICIT_CACHE)


def is_causal_lm(model: Any) -> bool:
    """A transformers model that generates from a cache of its own (decoder-only)."""
    return model_kind(model) == CAUSAL_LM
