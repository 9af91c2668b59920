"""The INT4 pass's options (``Int4Options``, what ``options={"int4": {...}}`` and the CLI's
``--int4-*`` flags parse into) and one matched linear (``LinearMatch``): the types the pass
(passes/quantize_int4.py) and the planning of its weights (passes/_quantize_plan.py) share,
in a module of their own so neither imports the other back."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from graphopt.ops.quant import GROUP_SIZES
from graphopt.quant.groupwise import DEFAULT_SEARCH, DEFAULT_SYMMETRIC, SCALE_DTYPE_NAMES, SEARCHES


@dataclass
class Int4Options:
    group_size: int = field(default=32, metadata={"help": "weights per scale along K: 32, 64 or 128"})
    group_size_8bit: int = field(default=128, metadata={
        "help": "weights per scale of the 8-bit weights (LM head, layers the budget moves, 8-bit embeddings): "
                "32, 64 or 128"})
    symmetric: bool = field(default=DEFAULT_SYMMETRIC, metadata={
        "help": "no zero points (an implied 8); false (default) stores a 4-bit zero point per group"})
    scale_dtype: str = field(default="auto", metadata={
        "help": "dtype of the scales: auto (the activations' dtype, what MatMulNBits reads) | float16 | "
                "bfloat16 | float32"})
    skip: list = field(default_factory=list, metadata={
        "help": 'fnmatch patterns of parameter names to leave in full precision, e.g. ["*lm_head*"]'})
    min_size: int = field(default=0, metadata={"help": "leave weights with fewer elements in full precision"})
    search: str = field(default=DEFAULT_SEARCH, metadata={
        "help": "rtn (default) | gptq: calibrated on activations; SmolLM2-135M 202-406 s vs rtn 8 s | "
                "mse: weight error"})
    calibration: list = field(default_factory=list, metadata={
        "help": "token ids to calibrate on (gptq, budget); empty: the example inputs"})
    act_order: bool = field(default=True, metadata={
        "help": "gptq: quantize the input channels with the most activation energy first (groups stay block-wise)"})
    head_bits: int = field(default=8, metadata={
        "help": "bits of a linear whose result is a graph output (an LM head): 4, 8, or 32 to keep it float"})
    budget: float = field(default=0.0, metadata={
        "help": "byte budget as a fraction of fp32 bytes: layers with most output error go to 8 bits while it fits"})
    embedding_bits: int = field(default=0, metadata={
        "help": "bits of embedding tables (graphopt.quantized_embedding, GatherBlockQuantized on ORT): "
                "0 keeps them float, 4 or 8"})

    def __post_init__(self) -> None:
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"group_size {self.group_size} is not valid; choose one of: "
                             f"{', '.join(map(str, GROUP_SIZES))}")
        if self.group_size_8bit not in GROUP_SIZES:
            raise ValueError(f"group_size_8bit {self.group_size_8bit} is not valid; choose one of: "
                             f"{', '.join(map(str, GROUP_SIZES))}")
        if self.scale_dtype != "auto" and self.scale_dtype not in SCALE_DTYPE_NAMES:
            raise ValueError(f"scale_dtype {self.scale_dtype!r} is not valid; choose one of: auto, "
                             f"{', '.join(SCALE_DTYPE_NAMES)}")
        if self.search not in SEARCHES:
            raise ValueError(f"search {self.search!r} is not valid; choose one of: {', '.join(SEARCHES)}")
        if isinstance(self.skip, str):
            self.skip = [self.skip]
        if not all(isinstance(p, str) for p in self.skip):
            raise ValueError(f"skip must be a list of name patterns, got {self.skip!r}")
        if not isinstance(self.min_size, int) or self.min_size < 0:
            raise ValueError(f"min_size must be a non-negative int, got {self.min_size!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.calibration):
            raise ValueError("calibration must be a list of token ids (non-negative ints)")
        if self.head_bits not in (4, 8, 32):
            raise ValueError(f"head_bits {self.head_bits!r} is not valid; choose 4, 8 or 32 (float)")
        if not isinstance(self.budget, (int, float)) or not (self.budget == 0 or 0 < self.budget <= 1):
            raise ValueError(f"budget must be 0 (none) or a fraction of the fp32 bytes in (0, 1], got {self.budget!r}")
        if self.embedding_bits not in (0, 4, 8):
            raise ValueError(f"embedding_bits {self.embedding_bits!r} is not valid; choose 0 (float), 4 or 8")

    def group_8bit(self, k: int) -> int:
        """The group of an 8-bit weight K wide: ``group_size_8bit``, or the largest smaller
        size that pads K by at most an eighth (a 64-wide table would store twice its codes
        in groups of 128)."""
        for group in sorted((g for g in GROUP_SIZES if g <= self.group_size_8bit), reverse=True):
            if (-k) % group * 8 <= k:
                return group
        return min(GROUP_SIZES)


@dataclass
class LinearMatch:
    gemm: fx.Node  # the node replaced: mm / addmm / linear / qkv_proj
    x: fx.Node  # what the int4 GEMM reads (the 2-D view for mm-style graphs)
    weight: fx.Node  # get_attr of the [N, K] weight
    bias: fx.Node | None
    sizes: list[int] | None  # qkv_proj's split widths
