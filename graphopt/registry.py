"""Where passes and targets are found.

Passes: every module ``graphopt.passes.<name>`` exports one pass object called
``<name>`` (file name = pass name, as STYLE.md asks); the registry imports them all.
Targets: a fixed table of import paths, imported only when a target is asked for, so
a missing optional package costs nothing until it is needed.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from graphopt.errors import OptionsError
from graphopt.pass_manager import Pass


@functools.cache
def all_passes() -> dict[str, Pass]:
    """Every registered pass by name, in module-name order."""
    import graphopt.passes as package

    found: dict[str, Pass] = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        obj = getattr(module, info.name, None)
        if obj is None:
            raise ImportError(f"graphopt.passes.{info.name} must export a pass object named {info.name}")
        found[obj.name] = obj
    return found


def get_pass(name: str) -> Pass:
    passes = all_passes()
    key = name.replace("-", "_")
    if key not in passes:
        raise OptionsError(f"unknown pass {name!r}; known passes: {', '.join(passes)}")
    return passes[key]


# target name -> "module:attribute" of its Target object (see graphopt.targets).
TARGETS = {
    "eager": "graphopt.backends.eager:eager",
    "onnxruntime": "graphopt.backends.onnxruntime.target:onnxruntime",
    "triton": "graphopt.backends.triton.target:triton",
    "tensorrt": "graphopt.backends.tensorrt.target:tensorrt",
}
