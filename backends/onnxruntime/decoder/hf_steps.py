"""transformers causal LMs behind the flat cache interface of ``export_kv_cache``.

``HFCacheStep(model)(input_ids)`` is the prefill: ``-> (logits, k_0, v_0, k_1, ...)``;
``HFCacheStep(model)(input_ids, k_0, v_0, ...)`` a decode step: ``-> (logits, present k_0,
...)``, the same interface as generate.PrefillStep / DecodeStep give graphopt's built-in
Llama. Both run graphopt.generation.runner.HFCausalStep, the adapter graphopt.generate's eager
reference decodes with, so what is exported is that forward: a DynamicCache built from the
tensors inside it (its update is the ``cat(past, new, -2)`` the ORT lowering turns into
GroupQueryAttention with past/present), positions counted from the past length, and the
logits of the last position only (greedy decoding reads nothing else).

The attention mask. Eagerly, transformers' sdpa path passes no mask for a batch without
padding when the query is one token or the whole sequence, and lets SDPA's ``is_causal``
do the work. Under torch.export it always builds the mask, because an exported graph keeps
the ``is_causal`` of the example's query length for every length (pytorch#108108). Each
graph here has one query length by construction (the prompt with no past; one token), so
while exporting the step switches the model to a registered copy of the sdpa attention that
mask creation does not know: the graph gets what eager runs, no mask, causal for the prompt.
A masked attention would lower to MultiHeadAttention with an attention bias, never to
GroupQueryAttention with past/present. Models whose mask carries more than causality (a
sliding window) or whose attention does not dispatch through transformers'
AttentionInterface keep their masks (``mask_kept`` says why).

Precondition: no padding; the exported models take no attention_mask. A padded batch
decodes on ORT's in-place decoder (inplace_cache.py), where GroupQueryAttention's per-row
lengths, not a mask, keep each row to its own tokens; it uses the same unmasked sdpa.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor, nn

# The name of the sdpa copy; mask creation returns None for any name it has no mask for.
UNMASKED_SDPA = "graphoptunmasked_sdpa"


def mask_kept(model: nn.Module) -> str | None:
    """Why ``model``'s exported attention keeps transformers' mask; None when it can go."""
    config = model.config.get_text_config(decoder=True)
    if config._attn_implementation != "sdpa":
        # eager attention applies causality only through the mask
        return f"its attention implementation is {config._attn_implementation!r}, not 'sdpa'"
    if getattr(config, "alibi", False):  # Falcon-RW, MPT: the mask is where the bias is added (and read)
        return "its ALiBi position bias is part of the mask"
    if _windowed(config):
        return f"its sliding window ({config.sliding_window} tokens) is part of the mask"
    can_dispatch = getattr(type(model), "_can_set_attn_implementation", None)
    if can_dispatch is None or not can_dispatch():
        return "its attention does not dispatch through transformers' AttentionInterface"
    return None


def _windowed(config) -> bool:
    """Whether transformers' mask carries a sliding window. A config that lists ``layer_types``
    builds a window mask only for its non-full layers: Qwen2-MoE keeps ``sliding_window`` (0)
    with every layer "full_attention", which is a causal mask and nothing more."""
    if getattr(config, "sliding_window", None) is None:
        return False
    layer_types = getattr(config, "layer_types", None)
    return layer_types is None or any(kind != "full_attention" for kind in layer_types)


class HFCacheStep(nn.Module):
    """``(input_ids, *past) -> (logits [B, 1, V], *present)`` for a transformers causal LM;
    the prefill without a past, a decode step with one (past flattened k_0, v_0, k_1, ...)."""

    def __init__(self, model: nn.Module) -> None:
        from graphopt.generation.runner import HFCausalStep

        super().__init__()
        self.step = HFCausalStep(model)
        self.mask_kept = mask_kept(model)

    def forward(self, input_ids: Tensor, *past: Tensor) -> tuple[Tensor, ...]:
        from graphopt.generation.runner import positions

        batch, length = input_ids.shape
        start = past[0].shape[2] if past else 0
        position_ids = positions(batch, start, length, input_ids.device)
        unmasked = torch.compiler.is_exporting() and self.mask_kept is None
        with unmasked_sdpa(self.step.model) if unmasked else contextlib.nullcontext():
            return self.step(input_ids, position_ids, list(past))


@contextlib.contextmanager
def unmasked_sdpa(model: nn.Module) -> Iterator[None]:
    """``model`` on the sdpa attention without a mask for the block, its own attention after."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(UNMASKED_SDPA, sdpa_attention_forward)
    config = model.config.get_text_config(decoder=True)  # what the attention layers and mask creation read
    saved = config._attn_implementation
    config._attn_implementation = UNMASKED_SDPA
    try:
        yield
    finally:
        config._attn_implementation = saved
