"""What every model source returns (``LoadedModel``), and the one line of an exception that
its ``ModelLoadError`` quotes. See ``graphopt/sources/load.py`` for the sources."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn


@dataclass
class LoadedModel:
    """A model ready to compile: ``module(*example_inputs)`` runs it once."""

    name: str
    module: nn.Module
    example_inputs: tuple
    family: str  # "llama" | "bert" | "hf-causal-lm" | "hf-encoder" | "custom"
    notes: list[str] = field(default_factory=list)  # how it was loaded, when the user should know


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
