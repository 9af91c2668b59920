"""Targets: where an optimized graph runs. The table, the protocol, hardware detection, ``auto``.

``TABLE`` is the one list of targets: each entry names where its Target object lives, what
``graphopt.generate`` decodes with on it, whether it runs a graph's nodes in order, where
``auto`` picks it and whether the fuzzer tries it. Every other list of targets derives from it
(``NAMES``, ``AUTO_ORDER``, the options' choices, the fuzzer's targets, graphopt.generate's
runners); adding a target is one entry here.

A target is an object with ``name``, ``unavailable_reason(config) -> str | None`` (None
when it can run here) and ``compile(gm, example_inputs, config) -> Compiled`` (the callable
and what the report says of it). Targets
live under backends/ and are imported by name (``TABLE``'s ``where``) only when asked for,
so a missing optional package costs nothing until it is needed.

This module imports nothing of graphopt but its errors: graphopt.config reads its names.
"""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from graphopt.errors import TargetUnavailable

if TYPE_CHECKING:
    import torch.fx as fx

# The hardware detect_hardware() tells apart.
HARDWARE = ("cuda", "rocm", "cpu")


@dataclass(frozen=True)
class TargetEntry:
    """One target, everything graphopt knows of it by name."""

    name: str
    where: str  # "module:attribute" of its Target object, imported when first asked for
    # graphopt.generate's step runner on it ("module:class", built as cls(model, config, max_length));
    # None: the static-cache step compiled for it (graphopt.generation.static)
    step_runner: str | None = None
    # A step runner made from a Checkpoint's file ("module:function(checkpoint, config, max_length)"),
    # numpy in and out; None: the checkpoint's module is built and decoded as any module
    checkpoint_runner: str | None = None
    # Runs a graph's nodes in order, so an in-place kv_cache_update happens before the attention
    # that reads the cache. ONNX Runtime orders by data dependencies only.
    runs_in_order: bool = False
    auto_on: tuple[str, ...] = ()  # hardware where target="auto" tries it first (eager is always last)
    fuzzed: bool = True  # in `graphopt fuzz`'s default targets


TABLE: tuple[TargetEntry, ...] = (
    TargetEntry("eager", "graphopt.backends.eager:eager", runs_in_order=True),
    TargetEntry("onnxruntime", "graphopt.backends.onnxruntime.target:onnxruntime",
                step_runner="graphopt.backends.onnxruntime.decoder.decoder:OrtRunner",
                checkpoint_runner="graphopt.backends.onnxruntime.decoder.from_checkpoint:checkpoint_runner",
                auto_on=("cpu",)),
    TargetEntry("triton", "graphopt.backends.triton.target:triton", runs_in_order=True, auto_on=("cuda", "rocm")),
    # needs TensorRT and a GPU; no lowering the fuzzer's graphs exercise yet
    TargetEntry("tensorrt", "graphopt.backends.tensorrt.target:tensorrt", fuzzed=False),
)
NAMES = tuple(t.name for t in TABLE)
ENTRIES = {t.name: t for t in TABLE}
# What target="auto" tries, in order, for each kind of hardware.
AUTO_ORDER = {hw: (*(t.name for t in TABLE if hw in t.auto_on), "eager") for hw in HARDWARE}

# Device nodes a GPU driver makes (NVIDIA's, AMD's kernel fusion driver). Without one no torch
# build can see a GPU, so the answer "cpu" costs no torch import (2.7 s): a warm
# `graphopt generate model.gguf` on a CPU machine resolves auto without torch.
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


@dataclass
class Compiled:
    """What a target's ``compile`` returns: the graph's callable (``fn``, also reached by calling
    this object) and what the compile report should say of it."""

    fn: Callable
    notes: list[str] = field(default_factory=list)  # what ran where (ops kept on reference, a per-shape build)
    # each op the target did not run as itself: {"op", "count", "reason", "how": "decomposed" | "eager"}
    off_target_ops: list[dict] = field(default_factory=list)
    near_misses: list = field(default_factory=list)  # graphopt.pass_manager.NearMiss: the target's own refusals
    partitions: list[dict] = field(default_factory=list)  # {"where", "nodes"} per run of a graph cut between runtimes
    strategy: str = ""  # which of the target's ways of compiling made it

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


class Target(Protocol):
    """``config`` is a graphopt.config.Options (not imported here: config imports this module)."""

    name: str

    def unavailable_reason(self, config: Any) -> str | None: ...

    def compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any] | None, config: Any) -> Compiled: ...


@functools.cache
def detect_hardware() -> str:
    """``"cuda"`` (NVIDIA), ``"rocm"`` (AMD, HIP build of torch) or ``"cpu"``."""
    if not any(os.path.exists(node) for node in GPU_DEVICE_NODES):
        return "cpu"
    import torch

    if torch.cuda.is_available():
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return "cpu"


def in_order_targets() -> tuple[str, ...]:
    """Targets that run a graph's nodes in order (an in-place cache update before its reader)."""
    return tuple(t.name for t in TABLE if t.runs_in_order)


def fuzzed_targets() -> tuple[str, ...]:
    return tuple(t.name for t in TABLE if t.fuzzed)


def get_target(name: str) -> Target:
    """The target object; TargetUnavailable (one line) when its module cannot load."""
    module_name, attr = ENTRIES[name].where.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and error.name.startswith("graphopt"):
            raise TargetUnavailable(f"target {name!r} is not part of this graphopt version yet") from error
        raise TargetUnavailable(
            f"target {name!r} needs the Python package {error.name!r}; install it with "
            f"pip install 'graphopt[{name}]'") from error
    return getattr(module, attr)


def resolve_target(config: Any) -> tuple[Target, list[str]]:
    """The target to use and, for ``auto``, why each earlier choice was passed over."""
    if config.target != "auto":
        target = get_target(config.target)
        reason = target.unavailable_reason(config)
        if reason:
            raise TargetUnavailable(f"target {config.target!r} cannot run here: {reason}")
        return target, []
    skipped = []
    for name in AUTO_ORDER[detect_hardware()]:
        try:
            target = get_target(name)
        except TargetUnavailable as error:
            skipped.append(str(error))
            continue
        reason = target.unavailable_reason(config)
        if reason is None:
            return target, skipped
        skipped.append(f"{name}: {reason}")
    raise TargetUnavailable("no target can run here: " + "; ".join(skipped))


def targets_to_compare(requested: str | None = None) -> list[str]:
    """The targets a comparison runs: the comma list ``requested``, or eager and the first
    choice of ``auto`` on this hardware (whether or not it can load here: the run says why)."""
    if requested:
        return requested.split(",")
    return list(dict.fromkeys(("eager", AUTO_ORDER[detect_hardware()][0])))
