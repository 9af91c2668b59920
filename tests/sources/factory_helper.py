"""Factories for the ``package.module:factory`` model specs in test_load.py."""

from __future__ import annotations

import torch
from torch import nn

from graphopt import models


def make() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A small custom module with its own inputs."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU()), (torch.randn(2, 8),)


def make_llama(seed: int) -> nn.Module:
    """A module alone, built-in kind: the loader derives example inputs."""
    return models.build("llama-tiny", seed=seed)


def make_plain() -> nn.Module:
    return nn.Linear(4, 4)


def broken() -> nn.Module:
    raise RuntimeError("out of coffee")


not_callable = 3
