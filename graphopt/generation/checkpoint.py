"""A model known by its file, built only when it has to be.

``graphopt.generate`` takes a ``Checkpoint`` in place of a module. A target with a runner made
from the file (``CHECKPOINT_RUNNERS``: the onnxruntime decoder, exported once and kept,
keyed by ``identity``) decodes it without building the module; any other target calls
``build()`` and decodes the module as usual.

``decode_checkpoint`` imports no torch: the kept decoder runs on numpy arrays through the
same decode loop (``loop.drive``), so a warm ``graphopt generate model.gguf`` spends its time
opening the session and decoding, not importing torch (2.7 s and 170 MB here).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from graphopt.config import Options
from graphopt.errors import TargetUnavailable
from graphopt.generation.loop import GenerateResult, TokenCallback, drive
from graphopt.generation.sampling import Sampler, StopConditions, array_module
from graphopt.targets import TABLE

if TYPE_CHECKING:
    from torch import nn

# Targets whose runner is made from a Checkpoint's file, as "module:function(checkpoint,
# config, max_length)" returning a step runner on numpy arrays (graphopt.targets' table); it raises
# TargetUnavailable when its runtime is not installed (the module is then built and decoded as usual).
CHECKPOINT_RUNNERS: dict[str, str] = {t.name: t.checkpoint_runner for t in TABLE if t.checkpoint_runner}


@dataclass
class Checkpoint:
    """``identity``: changes whenever the file could give another model; ``build()``: the
    module (lazy weights where the source has them); ``name``: for messages."""

    identity: str
    build: Callable[[], "nn.Module"]
    name: str
    eos_token_ids: tuple[int, ...] = ()
    notes: list[str] = field(default_factory=list)
    # Raises graphopt.memory.MemoryNeeded when building would not fit; called before building.
    check_memory: Callable[[], None] = lambda: None
    # Work on the file's weights that can run beside an export, in a process of its own:
    # ``run(folder)`` writes it, ``use(folder)`` lets the export read it (sources/gguf_prepack.py).
    prepack: Any = None


def served_target(config: Options) -> str | None:
    """The target ``config`` decodes a checkpoint on when it has a file runner, else None.
    ``auto`` resolves by the hardware alone (graphopt.targets.detect_hardware needs no torch
    on a machine without a GPU)."""
    from graphopt.targets import AUTO_ORDER, detect_hardware

    name = AUTO_ORDER[detect_hardware()][0] if config.target == "auto" else config.target
    return name if name in CHECKPOINT_RUNNERS else None


def start_checkpoint(checkpoint: Checkpoint, config: Options) -> None:
    """Let the target's file runner begin what it will need (the onnxruntime decoder's export
    in a child, or its kept session in a thread) while the caller does other work;
    ``decode_checkpoint`` with the same config takes it up. Does nothing for a target without a
    file runner or a ``start_decoder``."""
    name = served_target(config)
    if name is None:
        return
    module = importlib.import_module(CHECKPOINT_RUNNERS[name].split(":")[0])
    start = getattr(module, "start_decoder", None)
    if start is not None:
        start(checkpoint, config.replace(target=name))


def decode_checkpoint(checkpoint: Checkpoint, input_ids: Any, max_new_tokens: int, *, attention_mask: Any = None,
                      sampling: dict | None = None, stop: StopConditions | None = None, max_length: int,
                      config: Options, on_token: TokenCallback | None = None) -> GenerateResult | None:
    """Decode ``checkpoint`` on its target's file runner, or None when its target has none
    (the caller builds the module). ``input_ids`` and ``attention_mask`` are numpy arrays or
    torch tensors (checked by the caller); the result's arrays are of the same kind."""
    name = served_target(config)
    if name is None or max_new_tokens == 0:
        return None
    module, attr = CHECKPOINT_RUNNERS[name].split(":")
    try:
        runner = getattr(importlib.import_module(module), attr)(checkpoint, config.replace(target=name), max_length)
    except TargetUnavailable:
        return None
    torch_in = array_module(input_ids).__name__ == "torch"
    ids = input_ids.cpu().numpy() if torch_in else input_ids
    mask = attention_mask.cpu().numpy() if torch_in and attention_mask is not None else attention_mask
    if mask is not None and bool(mask.all()):
        mask = None
    callback = on_token
    if torch_in and on_token is not None:
        import torch

        def callback(token, live):  # the caller sees tensors, as it gave them
            on_token(torch.from_numpy(token), torch.from_numpy(live))
    sampling = {"do_sample": False, "temperature": 1.0, "top_k": None, "top_p": None, "seed": None, **(sampling or {})}
    result = drive([runner], ids, mask, max_new_tokens, [Sampler(**sampling)], stop or StopConditions(), callback)[0]
    result.notes[:0] = list(checkpoint.notes)
    if torch_in:
        import torch

        result.sequences = torch.from_numpy(result.sequences).to(input_ids.device)
    return result
