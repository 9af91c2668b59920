"""Serve a recompiled graph from an earlier dynamic graph's session, when it is an instance of it.

Dynamo never treats a size of 1 as dynamic (its 0/1 specialization). A model that has been
called with batches 4 and 16 has one graph with a dynamic batch, guarded ``2 <= batch``; a
batch of 1 then fails that guard and dynamo traces the model again, with the batch fixed at 1.
That graph is the dynamic one with ``s0 = 1`` substituted: the same ops on the same weights.
The session exported for the dynamic graph computes it already (an ONNX model has no guards,
and its dynamic axes take any size), so exporting again would only cost time (a minute on
llama-small) and a second copy of the weights in memory.

``graph_instance.instance_of(earlier, graph)`` proves the substitution node by node, before
any reuse (``graphopt/frontend/graph_instance.py`` says how).

Anything that does not match exports as usual; a match records a note in the report, not a
build. Entries live as long as the compiled callable that owns the session.

The same proof runs the other way when a dynamic graph arrives: a graph compiled before it may
be its instance (dynamo's first graph, static; with ``dynamic=True`` the first graph, whose
batch of 1 stayed static). That graph's session (another copy of every weight, plus its
arena: 600 MB on llama-small) is then released and its callable runs on the new session
(``Retirable``), so a model keeps one session, whatever order its shapes came in.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch.fx as fx

from graphopt.frontend.graph_instance import instance_of
from graphopt.frontend.graph_instance import shape as graph_shape

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


def remember(gm: fx.GraphModule, model: Any, session: Any, provider: str, owner: Any) -> Earlier:
    """Keep ``gm``'s session for later instances, as long as ``owner`` (its callable) lives."""
    entry = Earlier(gm, model, session, provider, graph_shape(gm))
    owner.graphopt_reusable = entry  # the callable holds the entry; the list only a weak ref
    _earlier.append(weakref.ref(entry))
    return entry


def find(gm: fx.GraphModule, provider: str, only: Earlier | None = None) -> tuple[Earlier, dict] | None:
    """The earlier dynamic graph ``gm`` is an instance of (the newest, or ``only``), with the
    binding of its symbols."""
    _earlier[:] = [ref for ref in _earlier if ref() is not None]
    shape = graph_shape(gm)
    for ref in [weakref.ref(only)] if only is not None else reversed(_earlier):
        entry = ref()
        if entry is not None and entry.provider == provider and entry.shape == shape:
            binding = instance_of(entry.gm, gm)
            if binding is not None:
                return entry, binding
    return None


class Retirable:
    """A compiled graph's callable whose session a later dynamic graph's session may replace.

    ``report`` is the graph's own, which gets a note when that happens."""

    def __init__(self, gm: fx.GraphModule, provider: str, run: Callable, report: Any) -> None:
        self.gm, self.provider, self.run, self.report = gm, provider, run, report

    def __call__(self, *args: Any) -> Any:
        return self.run(*args)

    def __getattr__(self, name: str) -> Any:
        """The runner's own attributes (``session``, ``onnx_model``)."""
        if name == "run":  # not set yet: no runner to ask
            raise AttributeError(name)
        return getattr(self.run, name)


_compiled: list[weakref.ref] = []


def retirable(gm: fx.GraphModule, provider: str, run: Callable, report: Any) -> Retirable:
    """``run`` wrapped so that a later dynamic graph it is an instance of can take it over."""
    wrapped = Retirable(gm, provider, run, report)
    _compiled.append(weakref.ref(wrapped))
    return wrapped


def release_static_instances(gm: fx.GraphModule, provider: str, is_static: Callable[[fx.GraphModule], bool],
                             stand_in: Callable[[Retirable], Callable]) -> int:
    """Before ``gm`` (a dynamic graph) is built: every live static compiled graph that is an
    instance of it gives up its session now and runs ``stand_in(it)`` instead, until
    ``retire_instances`` points it at ``gm``'s session. The build then adds its copy of the
    weights after theirs is gone, not on top of it (model.generate's static prefill: one
    session fewer at the peak). Returns how many."""
    _compiled[:] = [ref for ref in _compiled if ref() is not None]
    shape = graph_shape(gm)
    released = 0
    for ref in list(_compiled):
        earlier = ref()
        if earlier is None or earlier.provider != provider or not is_static(earlier.gm):
            continue
        if graph_shape(earlier.gm) != shape or instance_of(gm, earlier.gm) is None:
            continue
        earlier.run = stand_in(earlier)
        released += 1
    return released


def retire_instances(provider: str, serve: Callable[[fx.GraphModule], Callable | None]) -> int:
    """Point every live compiled callable that ``serve`` can run on another session at that
    session, dropping its own; returns how many. ``serve(gm)`` is the target's own reuse
    against the new dynamic graph (the callable, or None when ``gm`` is not its instance)."""
    _compiled[:] = [ref for ref in _compiled if ref() is not None]
    retired = 0
    for ref in list(_compiled):
        earlier = ref()
        if earlier is None or earlier.provider != provider:
            continue
        served = serve(earlier.gm)
        if served is None:
            continue
        earlier.run = served  # the old runner, and with it the session, has no other owner
        note = ("onnxruntime: a dynamic graph compiled later has this graph as an instance, so its "
                "session serves this graph too; the session this graph ran on before was released")
        log.info("graphopt: %s", note)
        if earlier.report is not None:
            earlier.report.notes.append(note)
        retired += 1
    return retired
