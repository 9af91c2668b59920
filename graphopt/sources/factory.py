"""``package.module:factory`` specs for ``load``: a callable, imported from the current
directory or PYTHONPATH, that returns a module or ``(module, example_inputs)``."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from graphopt import models
from graphopt.sources.common import LoadedModel, first_line
from graphopt.errors import ModelLoadError


@contextlib.contextmanager
def _cwd_importable() -> Iterator[None]:
    # A console script's sys.path starts at its own bin/ directory, so `mymodels:make` next
    # to the user would not import without this.
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added:
            sys.path.remove(cwd)


def from_factory(spec: str, seed: int, batch: int, seq_len: int) -> LoadedModel:
    module_name, _, attr = spec.partition(":")
    if not all(p.isidentifier() for p in module_name.split(".")) or not all(p.isidentifier() for p in attr.split(".")):
        raise ModelLoadError(f"factory spec {spec!r} must look like package.module:function")
    try:
        with _cwd_importable():
            target: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise ModelLoadError(
            f"cannot import {module_name!r} for {spec!r} ({type(exc).__name__}: {first_line(exc)}); "
            "make it importable from the current directory or PYTHONPATH"
        ) from None
    for part in attr.split("."):
        target = getattr(target, part, None)
    if not callable(target):
        raise ModelLoadError(f"{module_name} has no callable {attr!r}; check the name after the colon in {spec!r}")
    try:
        takes_seed = "seed" in inspect.signature(target).parameters
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        takes_seed = False
    try:
        result = target(seed=seed) if takes_seed else target()
    except Exception as exc:
        raise ModelLoadError(
            f"factory {spec} raised {type(exc).__name__}: {first_line(exc)}; fix the factory"
        ) from None
    module, inputs = result if isinstance(result, tuple) and len(result) == 2 else (result, None)
    if not isinstance(module, nn.Module):
        raise ModelLoadError(
            f"factory {spec} returned {type(result).__name__}; return an nn.Module or (module, example_inputs)"
        )
    if inputs is None:
        inputs = _inputs_for_module(spec, module, batch, seq_len, seed)
    elif isinstance(inputs, Tensor):
        inputs = (inputs,)
    elif isinstance(inputs, list):
        inputs = tuple(inputs)
    elif not isinstance(inputs, tuple):
        raise ModelLoadError(f"factory {spec} returned example inputs of type {type(inputs).__name__}; return a tuple")
    return LoadedModel(spec, module.eval(), inputs, "custom")


def _inputs_for_module(spec: str, module: nn.Module, batch: int, seq_len: int, seed: int) -> tuple:
    """Example inputs for a factory's module when it gave none and its kind says what they are."""
    if isinstance(module, (models.LlamaForCausalLM, models.BertModel)):
        return models.example_inputs(module, batch=batch, seq_len=seq_len, seed=seed)
    vocab = getattr(getattr(module, "config", None), "vocab_size", None)
    if isinstance(vocab, int):
        gen = torch.Generator().manual_seed(seed)
        return (torch.randint(0, vocab, (batch, seq_len), generator=gen),)
    raise ModelLoadError(
        f"factory {spec} returned a {type(module).__name__} without example inputs; return (module, example_inputs)"
    )
