"""ONNX translations of graphopt ops, one module per op family.

Each public module here defines ``TRANSLATIONS``: a dict from an op overload
(``torch.ops.graphopt.rms_norm.default``) to a function torch.onnx's exporter calls to emit
that op's ONNX nodes (see ``_common``). :func:`translation_table` discovers the modules with
pkgutil and merges their dicts, so a new family (``int4.py`` for ``graphopt.int4_linear`` ->
``MatMulNBits``) is one new file and no edit elsewhere. Two modules claiming the same op is
an error, not a silent override. An aten op is here only where torchlib's own translation
needs a fix (``index_put``: one ScatterND, and no onnx-ir warning a user cannot act on).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from typing import Callable


@functools.cache
def translation_table() -> dict[object, Callable]:
    """Every op overload with a translation -> its translation function."""
    table: dict[object, Callable] = {}
    owner: dict[object, str] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        entries = getattr(module, "TRANSLATIONS", None)
        if not isinstance(entries, dict):
            raise ImportError(f"{module.__name__} must define a TRANSLATIONS dict (op overload -> function)")
        for target, fn in entries.items():
            if target in table:
                raise ImportError(f"{target} is translated by both {owner[target]} and {module.__name__}")
            table[target], owner[target] = fn, module.__name__
    return table
