"""The rounding every quantizer here shares: codes to the nearest integer (ties to even),
a scale rounded to the dtype it is stored in, and the one intra-op thread their small
steps run on. Both round-to-nearest (``groupwise``) and GPTQ (``gptq``) use them, so
a weight quantized either way lands on the same grid."""

from __future__ import annotations

import torch
from torch import Tensor

from graphopt.threads import torch_threads


def one_thread():
    """Run the search on one intra-op thread. Its steps are small elementwise ops on a
    cache-sized chunk: threading them costs more in synchronisation than it saves, and on
    a loaded 2-core machine (parallel test workers) two threads made it 10x slower."""
    return torch_threads(1)


def round_scale(scale: Tensor, dtype: torch.dtype) -> Tensor:
    """The scale as it will be stored (rounded to ``dtype``), never 0 (an all-zero group
    gets scale 1: every code then dequantizes to exactly 0)."""
    finfo = torch.finfo(dtype)
    scale = scale.clamp(-finfo.max, finfo.max).to(dtype).float()
    return torch.where(scale == 0, torch.ones_like(scale), scale)


# Adding then subtracting 1.5 * 2**23 rounds a float32 of magnitude < 2**22 to the nearest
# integer, ties to even, exactly as torch.round does. Two adds instead of torch.round:
# on a loaded machine torch.round's threaded kernel took milliseconds per small tensor.
_ROUNDER = 12582912.0


def round_ties_even(t: Tensor) -> Tensor:
    return (t.clamp(-_ROUNDER / 4, _ROUNDER / 4) + _ROUNDER) - _ROUNDER
