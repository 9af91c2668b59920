"""Float attributes of a model (an RMSNorm's ``eps``, attention's ``scaling``) stay constants
under ``dynamic=True``.

Dynamo makes each such float a graph input (a symbolic float read from a 0-d tensor), and
every fusion that needs a constant would stop firing. ``specialize_float_attributes`` asks
dynamo to bake them in (it traces again with each value as a constant and a guard on it, so
a changed value recompiles). Floats passed as forward arguments stay dynamic; the near
misses they cause name them (``dynamic_float_inputs`` -> ``dynamic_float_readers`` ->
``name_dynamic_floats``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx as fx

from graphopt.report import CompileReport

log = logging.getLogger("graphopt")


def specialize_float_attributes(gm: fx.GraphModule) -> None:
    """Make dynamo bake float attributes of the model (``eps``, ``scaling``) into the graph.

    Under ``dynamic=True`` each such float reaches us as a 0-d tensor input read with
    ``.item()`` (a symbolic float). This is dynamo's own float specialisation, the one
    Inductor's tensorify pass triggers: name the symbols, restart analysis, and dynamo
    traces the frame again with those floats as constants plus a guard on each value
    (``...variance_epsilon == 1e-06``). One extra trace per frame, the first time only.
    Floats passed as forward arguments are left dynamic: they may change every call,
    and a guard on them would recompile each time.
    """
    try:
        from torch._dynamo.exc import TensorifyScalarRestartAnalysis
        from torch._dynamo.symbolic_convert import TensorifyState
    except ImportError:  # another torch: the floats stay inputs, and the near misses say which
        return
    # only attributes are constants of the model; a forward argument may change every call
    pending = [symbol for symbol, source in _float_placeholders(gm)
               if not _is_argument(source) and not TensorifyState.should_specialize(symbol)]
    if not pending:
        return
    for symbol in pending:
        TensorifyState.specialize(symbol)
    log.debug("graphopt: specializing %d float attribute(s); dynamo traces this frame again", len(pending))
    raise TensorifyScalarRestartAnalysis


def dynamic_float_inputs(gm: fx.GraphModule) -> dict[int, str]:
    """Placeholder index -> why, for each float that stays a graph input: the phrase a
    near miss it causes ends with."""
    out = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        if _float_symbol(node) is None:
            continue
        source = getattr(node.meta.get("grapharg"), "source", None)
        name = source.name if source is not None else node.name
        if source is None or _is_argument(source):
            out[i] = f"float input {name} is a forward argument: dynamic under dynamic=True"
        else:
            out[i] = f"float input {name} stayed dynamic: dynamo did not specialize it"
    return out


def _float_placeholders(gm: fx.GraphModule) -> list[tuple[str, Any]]:
    """(symbol name, dynamo source) of each placeholder that carries a symbolic float."""
    out = []
    for node in gm.graph.nodes:
        symbol = _float_symbol(node) if node.op == "placeholder" else None
        source = getattr(node.meta.get("grapharg"), "source", None)
        if symbol is not None and source is not None:
            out.append((symbol, source))
    return out


def _float_symbol(node: fx.Node) -> str | None:
    """``zf3`` for a dynamo placeholder holding an unspecialized float (a 0-d tensor read
    back with ``.item()``), else None."""
    memo = getattr(node.meta.get("example_value"), "item_memo", None)
    if not isinstance(memo, torch.SymFloat):
        return None
    expr = getattr(memo.node, "_expr", None)  # the symbol itself, not what it has been replaced with
    return getattr(expr, "name", None)


def _is_argument(source: Any) -> bool:
    """Whether a float is (an item of) a forward argument rather than an attribute of an
    object (a module, its config) or a global: only attributes are constants of the model."""
    from torch._dynamo.source import AttrSource, GlobalSource

    while source is not None:
        if isinstance(source, (AttrSource, GlobalSource)):
            return False
        source = getattr(source, "base", None)
    return True


def dynamic_float_readers(fw_gm: fx.GraphModule, dynamic_floats: dict[int, str]) -> dict[str, str]:
    """Node name -> the input's phrase, for each ATen node that reads a dynamic float
    (directly, or through casts and arithmetic on it as a 0-d tensor or a scalar)."""
    placeholders = [n for n in fw_gm.graph.nodes if n.op == "placeholder"]
    readers: dict[str, str] = {}
    for i, why in dynamic_floats.items():
        if i >= len(placeholders):
            continue
        todo, seen = [placeholders[i]], set()
        while todo:
            node = todo.pop()
            for user in node.users:
                readers.setdefault(user.name, why)
                val = user.meta.get("val")
                scalar = isinstance(val, (torch.SymFloat, torch.SymInt, float, int)) or (
                    isinstance(val, torch.Tensor) and val.dim() == 0)
                if scalar and user not in seen:  # ``.item()``, casts and scalar arithmetic carry the value on
                    seen.add(user)
                    todo.append(user)
    return readers


def name_dynamic_floats(report: CompileReport, readers: dict[str, str]) -> None:
    """Say in each "... is not a constant" near miss which dynamic float input it was."""
    for miss in report.near_misses:
        why = readers.get(miss.node)
        if why is not None and miss.reason.endswith("is not a constant"):
            miss.reason += f" ({why})"
