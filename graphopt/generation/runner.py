"""Step runners: how a target decodes, behind one protocol; and the eager runner.

Every causal LM looks the same to a runner through a step adapter: ``step(input_ids [B, S],
position_ids [B, S], past: [k0, v0, k1, v1, ...] each [B, H, S_past, D], attention_mask=None)
-> (logits, *present)``.
- :class:`ExplicitCacheStep` for modules whose ``forward(input_ids, past_key_values=None,
  position_ids=None)`` returns ``(logits, ((k, v), ...))`` (graphopt's reference Llama); it
  has no attention mask, so it takes no padded batch;
- :class:`HFCausalStep` for ``transformers`` causal LMs: it builds a ``DynamicCache`` from the
  tensors inside the forward (what torch.export traces), and passes an attention mask through.

:class:`EagerRunner` runs the model with its own growing cache: the reference every target is
compared with, and the runner graphopt falls back to.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Iterator, Protocol

import torch
from torch import Tensor, nn

from graphopt.errors import GraphoptError
from graphopt.report import CompileReport
from graphopt.sources.model_kind import CAUSAL_LM, EXPLICIT_CACHE, model_kind


class StepRunner(Protocol):
    """What a target gives the decode loop. It owns its KV cache: ``prefill`` starts one,
    ``step`` extends it by one token; both return the logits [B, V] of the last position.
    Optional: ``decoding()``, a context manager the loop holds from the prefill to the last
    step, where a runner sets torch's threads (the onnxruntime decoder: one; a runner that
    has one decodes alone, never in lockstep with others: generation/loop.py)."""

    target: str  # the target that decodes
    pads: bool  # takes a left-padded batch with an attention mask
    compiles: int  # compilations for the decode steps so far (cumulative)
    prefill_compiles: int
    compile_s: float
    cuda_graphs: str
    reports: list[CompileReport]

    def prepare(self, input_ids: Tensor, attention_mask: Tensor | None) -> None:
        """Compile or export what the prefill needs (untimed)."""

    def prefill(self, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor: ...

    def prepare_step(self, token: Tensor, position: int) -> None:
        """Compile what the step at ``position`` needs (untimed)."""

    def step(self, token: Tensor, position: int) -> Tensor: ...


class ExplicitCacheStep(nn.Module):
    """``forward(input_ids, past_key_values=None, position_ids=None) -> (logits, ((k, v), ...))``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, position_ids: Tensor, past: list[Tensor]) -> tuple[Tensor, ...]:
        pairs = tuple((past[i], past[i + 1]) for i in range(0, len(past), 2)) or None
        logits, cache = self.model(input_ids, past_key_values=pairs, position_ids=position_ids)
        return (logits, *[t for kv in cache for t in kv])


class HFCausalStep(nn.Module):
    """A ``transformers`` causal LM with its cache as tensors (DynamicCache built inside)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"  # transformers 5 renamed it
        self.extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    def forward(self, input_ids: Tensor, position_ids: Tensor, past: list[Tensor],
                attention_mask: Tensor | None = None) -> tuple[Tensor, ...]:
        from transformers import DynamicCache

        pairs = [(past[i], past[i + 1]) for i in range(0, len(past), 2)]
        cache = DynamicCache(pairs) if pairs else DynamicCache()
        mask = {} if attention_mask is None else {"attention_mask": attention_mask}
        out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=True, return_dict=True,
                         **{self.cache_arg: cache}, **mask, **self.extra)
        new = getattr(out, "cache", None) or out.past_key_values
        if hasattr(new, "layers"):
            flat = [t for layer in new.layers for t in (layer.keys, layer.values)]
        else:  # transformers 4.x keeps per-layer lists
            flat = [t for pair in zip(new.key_cache, new.value_cache) for t in pair]
        return (out.logits, *flat)


@contextlib.contextmanager
def inference_mode(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode (no dropout in the graphs) for the block, its own mode restored after."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for m, training in modes.items():
            m.training = training


def step_adapter(model: nn.Module) -> nn.Module:
    """The step adapter for ``model``; GraphoptError naming what is supported otherwise."""
    if isinstance(model, (ExplicitCacheStep, HFCausalStep)):
        return model
    kind = model_kind(model)
    if kind == CAUSAL_LM:
        return HFCausalStep(model)
    if kind == EXPLICIT_CACHE:
        return ExplicitCacheStep(model)
    raise GraphoptError(
        f"graphopt.generate cannot drive {type(model).__name__}: pass a transformers causal LM or a module whose "
        "forward(input_ids, past_key_values=None, position_ids=None) returns (logits, ((k, v), ...))")


def positions(batch: int, start: int, length: int, device) -> Tensor:
    """Position ids ``start .. start + length - 1`` for every row: [batch, length]."""
    return torch.arange(start, start + length, device=device).expand(batch, length)


def padded_positions(attention_mask: Tensor) -> Tensor:
    """Position ids of a left-padded batch: each row counts from its first real token (the
    padding's positions are never attended to, any value does)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


class EagerRunner:
    """The model run eagerly with its own growing (concatenated) cache: the reference."""

    target = "eager"
    compiles = prefill_compiles = 0
    compile_s = 0.0
    cuda_graphs = ""
    reports: list = []

    def __init__(self, model: nn.Module) -> None:
        self.step_fn = step_adapter(model)
        self.pads = isinstance(self.step_fn, HFCausalStep)
        self.past: list[Tensor] = []
        self.mask: Tensor | None = None

    def prepare(self, input_ids: Tensor, attention_mask: Tensor | None) -> None:
        if attention_mask is not None and not self.pads:
            raise GraphoptError(f"{type(self.step_fn.model).__name__} takes no attention mask, so it cannot decode "
                                "a padded batch; pass prompts of one length")

    def prefill(self, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        batch, prompt = input_ids.shape
        self.mask = attention_mask
        if attention_mask is None:
            logits, *self.past = self.step_fn(input_ids, positions(batch, 0, prompt, input_ids.device), [])
        else:
            logits, *self.past = self.step_fn(input_ids, padded_positions(attention_mask), [], attention_mask)
        return logits[:, -1]

    def prepare_step(self, token: Tensor, position: int) -> None:
        pass

    def step(self, token: Tensor, position: int) -> Tensor:
        if self.mask is None:
            logits, *self.past = self.step_fn(token, positions(token.shape[0], position, 1, token.device), self.past)
        else:
            self.mask = torch.cat([self.mask, self.mask.new_ones(token.shape[0], 1)], dim=1)
            position_ids = self.mask.long().sum(-1, keepdim=True) - 1
            logits, *self.past = self.step_fn(token, position_ids, self.past, self.mask)
        return logits[:, -1]
