"""Where passes and targets are found.

Passes: every module ``graphopt.passes.<name>`` exports one pass object called
``<name>`` (file name = pass name, as STYLE.md asks); the registry imports them all the
first time a pass is asked for. Code outside graphopt adds its own with
``graphopt.register_pass(p)``; tests plant passes for one ``with scoped_passes(p):`` block.
Targets are found through graphopt.targets' table.

This module depends on the pass protocol (graphopt.pass_manager) and nothing else of the
pipeline: graphopt.pipeline reads it, never the reverse.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import pkgutil
from types import MappingProxyType
from typing import Iterator, Mapping

from graphopt.errors import OptionsError
from graphopt.pass_manager import Pass

# Where graphopt's own passes live: one module per pass, found when a pass is first asked for.
PASS_PACKAGE = "graphopt.passes"
_passes: dict[str, Pass] = {}
_discovered = False


def _registry() -> dict[str, Pass]:
    """The registry, with graphopt's own passes imported on first use (importing them
    loads every pass module, which only the first pipeline needs to pay for)."""
    global _discovered
    if not _discovered:
        # By name, like graphopt.targets' table: the core finds the pass modules, it does not depend on them.
        package = importlib.import_module(PASS_PACKAGE)
        found: dict[str, Pass] = {}
        for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
            if info.name.startswith("_"):
                continue
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            obj = getattr(module, info.name, None)
            if obj is None:
                raise ImportError(f"{PASS_PACKAGE}.{info.name} must export a pass object named {info.name}")
            found[obj.name] = obj
        # Passes registered before discovery (a plugin imported early) win over nothing: keep them.
        _passes.update({name: p for name, p in found.items() if name not in _passes})
        _discovered = True
    return _passes


def all_passes() -> Mapping[str, Pass]:
    """Every registered pass by name: graphopt's own in module-name order, then registered
    ones. Read-only: change it with register_pass / unregister_pass."""
    return MappingProxyType(_registry())


def get_pass(name: str) -> Pass:
    passes = _registry()
    key = name.replace("-", "_")
    if key not in passes:
        raise OptionsError(f"unknown pass {name!r}; known passes: {', '.join(passes)}")
    return passes[key]


def _problem(p: object) -> str | None:
    """Why ``p`` is no pass the PassManager can run, or None."""
    name = getattr(p, "name", None)
    if not isinstance(name, str) or not name.isidentifier():
        return f"its name must be an identifier string (fuse_my_op), got {name!r}"
    summary = getattr(p, "summary", None)
    if not isinstance(summary, str) or not summary or "\n" in summary:
        return "it needs a one-line summary string"
    if not dataclasses.is_dataclass(getattr(p, "Options", None)):
        return "its Options must be a dataclass (graphopt.pass_manager.NoOptions when it takes none)"
    if not isinstance(getattr(p, "requires", None), tuple):
        return "its requires must be a tuple of pass names"
    if not callable(getattr(p, "run", None)):
        return "it needs a run(gm, ctx) -> PassResult method"
    return None


def register_pass(p: Pass, *, replace: bool = False) -> Pass:
    """Make ``p`` available by ``p.name`` to pipelines, ``options={"pipeline": [...]}`` and
    the CLI. Refuses a name already taken unless ``replace=True``. Returns ``p``."""
    problem = _problem(p)
    if problem is not None:
        raise OptionsError(f"cannot register pass {getattr(p, 'name', p)!r}: {problem}")
    passes = _registry()
    if p.name in passes and passes[p.name] is not p and not replace:
        raise OptionsError(f"a pass named {p.name!r} is already registered; pass replace=True to replace it")
    passes[p.name] = p
    return p


def unregister_pass(name: str) -> Pass:
    """Remove a pass (by name); returns it. Unknown names fail like get_pass."""
    p = get_pass(name)
    del _registry()[p.name]
    return p


@contextlib.contextmanager
def scoped_passes(*passes: Pass, remove: tuple[str, ...] = ()) -> Iterator[None]:
    """Register ``passes`` (replacing same-named ones) and unregister ``remove`` for the
    ``with`` block; afterwards the registry is exactly what it was, whatever the block did."""
    saved = dict(_registry())
    try:
        for name in remove:
            unregister_pass(name)
        for p in passes:
            register_pass(p, replace=True)
        yield
    finally:
        _passes.clear()
        _passes.update(saved)

