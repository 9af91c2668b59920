"""Pieces the CLI commands share: option parsing, model loading, timing."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

from graphopt.config import Options
from graphopt.errors import OptionsError

MODEL_HELP = ("a built-in model (see `graphopt models`), a Hugging Face config.json, a checkpoint "
              "directory with safetensors weights, a .gguf file (run on its own quantized weights), or "
              "package.module:factory")


def parse_options(pairs: Sequence[str], **given: Any) -> Options:
    """``["target=eager", "check_numerics=true"]`` plus flags -> validated Options."""
    values: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise OptionsError(f"--option expects key=value, got {pair!r}")
        values[key.strip()] = value.strip()
    values.update({k: v for k, v in given.items() if v is not None})
    return Options.parse(values)


def load(spec: str, seed: int, batch: int, seq_len: int):
    from graphopt.sources import load_model

    return load_model(spec, seed=seed, batch=batch, seq_len=seq_len)


def time_ms(fns: Sequence[Callable], inputs: Sequence[Any], repeat: int, warmup: int = 2) -> list[float]:
    """Median wall time in ms of each ``fn(*inputs)``, measured round-robin so that every
    function sees the same machine noise (these machines are shared), after ``warmup`` calls."""
    import torch

    samples: list[list[float]] = [[] for _ in fns]
    with torch.no_grad():
        for fn in fns:
            for _ in range(warmup):
                fn(*inputs)
        for _ in range(max(1, repeat)):
            for fn, times in zip(fns, samples):
                start = time.perf_counter()
                fn(*inputs)
                times.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(times) for times in samples]
