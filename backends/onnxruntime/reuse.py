"""Serve a recompiled graph from an earlier dynamic graph's session, when it is an instance of it.

Dynamo never treats a size of 1 as dynamic (its 0/1 specialization). A model that has been
called with batches 4 and 16 has one graph with a dynamic batch, guarded ``2 <= batch``; a
batch of 1 then fails that guard and dynamo traces the model again, with the batch fixed at 1.
That graph is the dynamic one with ``s0 = 1`` substituted: the same ops on the same weights.
The session exported for the dynamic graph computes it already (an ONNX model has no guards,
and its dynamic axes take any size), so exporting again would only cost time (a minute on
llama-small) and a second copy of the weights in memory.

``graph_instance.instance_of(earlier, graph)`` proves the substitution node by node, before
any reuse (``graphopt/graph_instance.py`` says how).

Anything that does not match exports as usual; a match records a note in the report, not a
build. Entries live as long as the compiled callable that owns the session.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from graphopt.graph_instance import instance_of
from graphopt.graph_instance import shape as graph_shape

log = logging.getLogger("graphopt")


@dataclass
class Earlier:
    """A dynamic graph's export and session, kept for graphs that are instances of it."""

    gm: fx.GraphModule
    model: Any  # OnnxModel
    session: Any  # onnxruntime.InferenceSession
    provider: str  # "cpu", "cuda", ...: a graph for another provider never matches
    shape: tuple  # the ops of its nodes: a quick filter before the full comparison


_earlier: list[weakref.ref] = []


def remember(gm: fx.GraphModule, model: Any, session: Any, provider: str, owner: Any) -> None:
    """Keep ``gm``'s session for later instances, as long as ``owner`` (its callable) lives."""
    entry = Earlier(gm, model, session, provider, graph_shape(gm))
    owner.graphopt_reusable = entry  # the callable holds the entry; the list only a weak ref
    _earlier.append(weakref.ref(entry))


def find(gm: fx.GraphModule, provider: str) -> tuple[Earlier, dict] | None:
    """The earlier dynamic graph ``gm`` is an instance of, with the binding of its symbols."""
    _earlier[:] = [ref for ref in _earlier if ref() is not None]
    shape = graph_shape(gm)
    for ref in reversed(_earlier):
        entry = ref()
        if entry is not None and entry.provider == provider and entry.shape == shape:
            binding = instance_of(entry.gm, gm)
            if binding is not None:
                return entry, binding
    return None
