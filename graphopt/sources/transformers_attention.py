"""transformers attention surgery for export: a causal LM traced without its mask where eager runs none.

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
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from torch import nn

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
