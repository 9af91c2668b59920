"""graphopt: a torch.compile backend and ONNX export tool for LLM inference.

    model = torch.compile(model, backend="graphopt", options={"target": "eager"})
    graphopt.reports()[-1].to_dict()   # what each pass did, op counts, fallbacks

Importing this package imports nothing heavy: the names below load on first use. A warm
``graphopt generate model.gguf`` runs a kept ONNX Runtime decoder and never imports torch
(2.7 s and 170 MB here). The ``graphopt::`` ops register with any module that builds graphs
(``graphopt.ir`` imports ``graphopt.ops``), or with ``import graphopt.ops``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
__all__ = ["compile", "reports", "reset", "Options", "CompileReport", "GraphoptError", "OptionsError",
           "describe_options", "generate", "register_pass", "unregister_pass", "scoped_passes"]

# Public name -> the module that defines it, imported when the name is first read.
_LAZY = {
    "Options": "graphopt.config", "describe_options": "graphopt.config",
    "GraphoptError": "graphopt.errors", "OptionsError": "graphopt.errors",
    "generate": "graphopt.generation",  # decoding on any target (graphopt.generate(...))
    "register_pass": "graphopt.registry", "scoped_passes": "graphopt.registry", "unregister_pass": "graphopt.registry",
    "CompileReport": "graphopt.report", "reports": "graphopt.report", "reset": "graphopt.report",
}


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'graphopt' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value  # read once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def compile(model: Any, options: dict | None = None, **torch_compile_kwargs: Any) -> Any:
    """``torch.compile(model, backend="graphopt", options=options)`` with the options
    checked now (keys, values, pass names, pass options) rather than at the first call."""
    import torch

    from graphopt.config import Options
    from graphopt.pipeline import build_pass_manager

    build_pass_manager(Options.parse(options))
    return torch.compile(model, backend="graphopt", options=options or None, **torch_compile_kwargs)
