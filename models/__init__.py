"""Reference models, by name, with seeded random weights.

Tests, benchmarks and the CLI need real model graphs without downloading checkpoints, so
each named size here builds a plain-torch model (``llama.py``, ``bert.py``) and fills it with
seeded random weights chosen to keep numerics non-trivial: matrices ~ N(0, 0.02) so logits
differ, norm weights ~ 1 + N(0, 0.1) and biases ~ N(0, 0.02) so that a fusion which drops a
weight or a bias shows up as a numeric mismatch instead of hiding behind ones and zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from . import bert, llama
from .bert import BertConfig, BertModel
from .llama import LlamaConfig, LlamaForCausalLM

__all__ = [
    "BertConfig",
    "BertModel",
    "LlamaConfig",
    "LlamaForCausalLM",
    "ModelInfo",
    "build",
    "config_of",
    "example_inputs",
    "init_weights",
    "list_models",
    "names",
]


@dataclass(frozen=True)
class ModelInfo:
    name: str
    family: str  # "llama" | "bert"
    params: int
    description: str


@dataclass(frozen=True)
class _Entry:
    family: str
    config: LlamaConfig | BertConfig
    description: str


_REGISTRY: dict[str, _Entry] = {
    "llama-tiny": _Entry(
        "llama",
        LlamaConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    intermediate_size=128, max_seq_len=256),
        "2-layer GQA Llama for unit tests (runs in milliseconds)",
    ),
    "llama-small": _Entry(
        "llama",
        LlamaConfig(vocab_size=32000, hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4,
                    intermediate_size=2816, max_seq_len=2048),
        "8-layer GQA Llama with a real 32k vocabulary, for benchmarks",
    ),
    "llama-medium": _Entry(
        "llama",
        LlamaConfig(vocab_size=32000, hidden_size=2048, num_layers=22, num_heads=32, num_kv_heads=4,
                    intermediate_size=5632, max_seq_len=2048),
        "TinyLlama-1.1B shape, for GPU benchmarks",
    ),
    "bert-tiny": _Entry(
        "bert",
        BertConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                   max_position=128),
        "2-layer BERT encoder for unit tests",
    ),
    "bert-small": _Entry(
        "bert",
        BertConfig(vocab_size=30522, hidden_size=512, num_layers=4, num_heads=8, intermediate_size=2048),
        "4-layer BERT encoder with the bert-base vocabulary",
    ),
}

_BUILDERS = {"llama": LlamaForCausalLM, "bert": BertModel}
_PARAM_COUNTS = {"llama": llama.param_count, "bert": bert.param_count}


def names() -> list[str]:
    return list(_REGISTRY)


def _entry(name: str) -> _Entry:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(_REGISTRY)}") from None


def config_of(name: str) -> LlamaConfig | BertConfig:
    """The config of a named size, without building the model."""
    return _entry(name).config


def list_models() -> list[ModelInfo]:
    return [
        ModelInfo(name, e.family, _PARAM_COUNTS[e.family](e.config), e.description)
        for name, e in _REGISTRY.items()
    ]


def build(name: str, seed: int = 0) -> nn.Module:
    """The named model in eval mode, float32 on the CPU, with weights drawn from ``seed``."""
    entry = _entry(name)
    # Built on the meta device so a large model is allocated once, not initialised twice.
    with torch.device("meta"):
        model = _BUILDERS[entry.family](entry.config)
    model.to_empty(device="cpu")
    init_weights(model, seed)
    return model.eval()


def init_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter from a private generator (the global RNG stays untouched)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            is_norm = isinstance(module, (llama.RMSNorm, nn.LayerNorm))
            for pname, p in module.named_parameters(recurse=False):
                if is_norm and pname == "weight":
                    p.normal_(1.0, 0.1, generator=gen)
                else:
                    p.normal_(0.0, 0.02, generator=gen)
            if hasattr(module, "reset_buffers"):
                module.reset_buffers()


def example_inputs(
    name_or_model: str | nn.Module, batch: int = 1, seq_len: int = 16, seed: int = 0
) -> tuple[Tensor, ...]:
    """Positional arguments for ``forward``: ``(input_ids,)`` for Llama, and
    ``(input_ids, attention_mask)`` for BERT with an all-ones mask, so the mask path is in the
    graph without making padded outputs part of any comparison."""
    if isinstance(name_or_model, str):
        config = config_of(name_or_model)
    elif isinstance(name_or_model, (LlamaForCausalLM, BertModel)):
        config = name_or_model.config
    else:
        raise ValueError(f"no example inputs for {type(name_or_model).__name__}; pass a built-in model or name")
    limit = config.max_seq_len if isinstance(config, LlamaConfig) else config.max_position
    if not 0 < seq_len <= limit:
        raise ValueError(f"seq_len {seq_len} is outside 1..{limit} for this model")
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=gen)
    if isinstance(config, LlamaConfig):
        return (input_ids,)
    return input_ids, torch.ones(batch, seq_len, dtype=torch.long)
