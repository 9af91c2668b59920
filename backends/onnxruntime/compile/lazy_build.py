"""A static graph that dynamo compiles again runs on torch first; its session comes at the second call.

When dynamo recompiles a frame and the new graph is still static, the new shape is often
one that is never seen again. transformers' ``model.generate`` is the common case: after a
prompt of N tokens, the first decode step is a static graph (a one-token input and a cache
of exactly N). The next step changes the cache length, and dynamo then compiles the
dynamic decode step that serves every later step. Exporting and opening a session for that
one call cost SmolLM2-135M about 5-9 s and a session's copy of the weights.

So a static recompile (``report.recompile_reason`` is set) gets ``BuildOnSecondCall``:
- Its first call runs the optimized graph on torch (the eager target, graphopt ops
  included), so the numbers are the same.
- Its second call exports it and opens the session (a build in the graph's report), and
  every later call runs there.
- A dynamic graph compiled in between that has it as an instance takes it over first
  (``reuse.retire_instances``), and then it never builds.

The same goes for a recompile whose tensors are static and only int inputs symbolic
(``INTS_NOTE``): transformers' sliding-window cache keeps counters that dynamo makes dynamic
once they change, so Gemma 3's first decode step is such a graph, called once. Its session,
built at its second call, takes the ints as inputs (``signatures.SizePlan.scalars``).

A graph that dynamo compiles for the first time builds at once, as before. The option
``lazy_recompiles=False`` makes recompiles build at once too.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch.fx as fx

log = logging.getLogger("graphopt")

NOTE = ("onnxruntime: dynamo recompiled this graph static, for one shape: its first call runs on torch, and its "
        "session is built at its second call (option lazy_recompiles)")
INTS_NOTE = ("onnxruntime: dynamo recompiled this graph with static tensor shapes, only int inputs symbolic: its "
             "first call runs on torch, and its session is built at its second call (option lazy_recompiles)")


class BuildOnSecondCall:
    """``build(args)`` makes the graph's ONNX Runtime callable on the second call; the first
    runs ``first`` (the graph on torch). Attribute reads go to the built callable."""

    def __init__(self, first: Callable | None, build: Callable[[list], Callable]) -> None:
        self.first, self.build, self.built = first, build, None  # no first: the next call builds

    def __call__(self, *args: Any) -> Any:
        if self.built is not None:
            return self.built(*args)
        if self.first is not None:
            first, self.first = self.first, None
            return first(*args)
        log.info("graphopt: onnxruntime builds a recompiled graph at its second call")
        self.built = self.build(list(args))  # the call's own tensors: this graph's only shape
        return self.built(*args)

    def __getattr__(self, name: str) -> Any:
        """The built callable's attributes (``session``, ``onnx_model``); none before it exists."""
        built = self.__dict__.get("built")
        if built is None:
            raise AttributeError(f"{name} (the session is built at the graph's second call)")
        return getattr(built, name)


def build_on_second_call(gm: fx.GraphModule, build: Callable[[list], Callable],
                         lay_out: Callable[[Any], Any]) -> BuildOnSecondCall:
    """``lay_out`` gives the first call's outputs the layout the session's would have: dynamo
    guards the next call's inputs on their strides, and a cache returned as torch's strided
    view one step and as the session's row-major tensor the next would recompile the graph
    that takes it (Mistral with a full 4-token window: a fourth graph and build)."""
    from graphopt.targets import get_target

    on_torch = get_target("eager").compile(gm, None, None).fn
    return BuildOnSecondCall(lambda *args: lay_out(on_torch(*args)), build)
