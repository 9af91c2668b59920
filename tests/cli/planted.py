"""Factories for CLI tests: models with near misses planted in them."""

import torch
from torch import nn


class NormOverWrongAxis(nn.Module):
    """An RMSNorm that reduces over dim 1: fuse_rms_norm must refuse it and say why."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(16))

    def forward(self, x):
        h = self.proj(x)
        good = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        bad = h * torch.rsqrt(h.pow(2).mean(1, keepdim=True) + 1e-6)
        return good + bad


def make_planted():
    torch.manual_seed(0)
    return NormOverWrongAxis().eval(), (torch.randn(2, 4, 16),)
