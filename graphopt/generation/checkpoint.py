"""A model known by its file, built only when it has to be.

``graphopt.generate`` takes a ``Checkpoint`` in place of a module. A step runner that can
serve one from a file it made earlier (the onnxruntime decoder, keyed by ``identity``) never
builds the module: a warm ``graphopt generate model.gguf`` reads no weights and imports no
model code. Any other runner calls ``build()`` and decodes the module as usual.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import nn


@dataclass
class Checkpoint:
    """``identity``: changes whenever the file could give another model; ``build()``: the
    module (lazy weights where the source has them); ``name``: for messages."""

    identity: str
    build: Callable[[], nn.Module]
    name: str
    eos_token_ids: tuple[int, ...] = ()
    notes: list[str] = field(default_factory=list)
    # Raises graphopt.memory.MemoryNeeded when building would not fit; called before building.
    check_memory: Callable[[], None] = lambda: None
