"""graphopt: a torch.compile backend and ONNX export tool for LLM inference.

    model = torch.compile(model, backend="graphopt", options={"target": "eager"})
    graphopt.reports()[-1].to_dict()   # what each pass did, op counts, fallbacks
"""

from __future__ import annotations

from typing import Any

import torch

import graphopt.ops  # noqa: F401  (registers the graphopt:: ops)
from graphopt.config import Options, describe_options
from graphopt.errors import GraphoptError, OptionsError
from graphopt.generation import generate  # decoding on any target (graphopt.generate(...))
from graphopt.registry import register_pass, scoped_passes, unregister_pass
from graphopt.report import CompileReport, reports, reset

__version__ = "0.1.0"
__all__ = ["compile", "reports", "reset", "Options", "CompileReport", "GraphoptError", "OptionsError",
           "describe_options", "generate", "register_pass", "unregister_pass", "scoped_passes"]


def compile(model: Any, options: dict | None = None, **torch_compile_kwargs: Any) -> Any:
    """``torch.compile(model, backend="graphopt", options=options)`` with the options
    checked now (keys, values, pass names, pass options) rather than at the first call."""
    from graphopt.pipeline import build_pass_manager

    build_pass_manager(Options.parse(options))
    return torch.compile(model, backend="graphopt", options=options or None, **torch_compile_kwargs)
