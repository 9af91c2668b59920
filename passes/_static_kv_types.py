"""What ``static_kv_cache`` and its graph surgery (``_static_kv_rebuild``) share: the pass's
options and the record of one matched cache. Apart so the surgery needs nothing of the pass
module that imports it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from graphopt.ops.kv_cache import LAYOUTS

CACHE_INPUT = "graphopt_kv_cache"  # meta key on the cache placeholders: their layer slot
KV_DTYPES = ("auto", "int8")


@dataclass
class Options:
    max_length: int = field(default=0, metadata={
        "help": "positions the static cache holds; 0 leaves the graph alone (graphopt.generate sets it)"})
    layout: str = field(default="bhsd", metadata={"help": "cache layout: bhsd | bshd | paged"})
    block_size: int = field(default=16, metadata={"help": "positions per block of the paged layout"})
    kv_dtype: str = field(default="auto", metadata={
        "help": "auto (the model's dtype) | int8 (per-token, per-head scales)"})

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r} is not one of {', '.join(LAYOUTS)}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype {self.kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
        if self.max_length < 0 or self.block_size < 1:
            raise ValueError(f"max_length ({self.max_length}) must be >= 0 and block_size ({self.block_size}) >= 1")

    def effective_length(self) -> int:
        """Positions the buffers really hold: paged rounds up to whole blocks."""
        if self.layout != "paged":
            return self.max_length
        return -(-self.max_length // self.block_size) * self.block_size


@dataclass
class CacheMatch:
    cat: fx.Node
    past: fx.Node  # the placeholder
    new: fx.Node
    chain: list[fx.Node]  # nodes between the placeholder and the cat (HF's lazy-init cat)
    attentions: list[fx.Node]  # SDPA / graphopt.attention ops reading it as k or v
    softmaxes: list[fx.Node] = field(default_factory=list)  # explicit form: softmax of q @ k^T
