"""transformers causal LMs behind the flat cache interface of ``export_kv_cache``.

``HFCacheStep(model)(input_ids)`` is the prefill: ``-> (logits, k_0, v_0, k_1, ...)``;
``HFCacheStep(model)(input_ids, k_0, v_0, ...)`` a decode step: ``-> (logits, present k_0,
...)``, the same interface as generate.PrefillStep / DecodeStep give graphopt's built-in
Llama. Both run graphopt.generation.runner.HFCausalStep, the adapter graphopt.generate's eager
reference decodes with, so what is exported is that forward: a DynamicCache built from the
tensors inside it (its update is the ``cat(past, new, -2)`` the ORT lowering turns into
GroupQueryAttention with past/present), positions counted from the past length, and the
logits of the last position only (greedy decoding reads nothing else).

The attention mask: while exporting, the step runs transformers' sdpa attention without a
mask where that is what eager runs (graphopt/sources/transformers_attention.py says why).

Precondition: no padding; the exported models take no attention_mask. A padded batch
decodes on ORT's in-place decoder (inplace_cache.py), where GroupQueryAttention's per-row
lengths, not a mask, keep each row to its own tokens; it uses the same unmasked sdpa.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

from graphopt.sources.transformers_attention import mask_kept, unmasked_sdpa


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
