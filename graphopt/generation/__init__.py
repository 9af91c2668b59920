"""Generation: one decode loop for every target (see api.py for ``graphopt.generate``).

- ``loop``: the loop itself (lockstep runners, stop conditions, streaming, timing);
- ``sampling``: greedy / temperature / top-k / top-p, and the stop conditions;
- ``runner``: the step-runner protocol, the model adapters and the eager runner;
- ``static``: the compiled static-cache runner (eager and triton targets);
- ``runner_cache``: each model's runners, kept from one call to the next (``forget`` drops them);
- ``checkpoint``: a model known by its file, decoded without building it where a target keeps
  a runner for the file (``decode_checkpoint``; no torch);
- the onnxruntime target's runner lives with its backend (backends/onnxruntime/decoder/).

The names below load on first use: ``loop``, ``sampling`` and ``checkpoint`` import no torch,
so a process that decodes a kept decoder never pays for it.
"""

import importlib
from typing import Any

__all__ = ["generate", "generate_with_reference", "eager_generate", "GenerateResult", "drive", "Sampler",
           "StopConditions", "StepRunner", "EagerRunner", "RUNNERS", "forget", "Checkpoint"]

_WHERE = {"generate": "api", "generate_with_reference": "api", "eager_generate": "api", "RUNNERS": "api",
          "GenerateResult": "loop", "drive": "loop", "Sampler": "sampling", "StopConditions": "sampling",
          "StepRunner": "runner", "EagerRunner": "runner", "forget": "runner_cache", "Checkpoint": "checkpoint"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'graphopt.generation' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"graphopt.generation.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
