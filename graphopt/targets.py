"""Targets: where an optimized graph runs. The protocol, hardware detection, ``auto``.

A target is an object with ``name``, ``unavailable_reason(config) -> str | None`` (None
when it can run here) and ``compile(gm, example_inputs, ctx) -> callable``. Targets
live under backends/ and are looked up by name through ``graphopt.registry.TARGETS``.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from graphopt.config import Options
from graphopt.errors import TargetUnavailable

if TYPE_CHECKING:
    import torch.fx as fx

# Device nodes a GPU driver makes (NVIDIA's, AMD's kernel fusion driver). Without one no torch
# build can see a GPU, so the answer "cpu" costs no torch import (2.7 s): a warm
# `graphopt generate model.gguf` on a CPU machine resolves auto without torch.
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


class Target(Protocol):
    name: str

    def unavailable_reason(self, config: Options) -> str | None: ...

    def compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any] | None, config: Options) -> Callable: ...


@functools.cache
def detect_hardware() -> str:
    """``"cuda"`` (NVIDIA), ``"rocm"`` (AMD, HIP build of torch) or ``"cpu"``."""
    if not any(os.path.exists(node) for node in GPU_DEVICE_NODES):
        return "cpu"
    import torch

    if torch.cuda.is_available():
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return "cpu"


# What target="auto" tries, in order, for each kind of hardware.
AUTO_ORDER = {
    "cuda": ("triton", "eager"),
    "rocm": ("triton", "eager"),
    "cpu": ("onnxruntime", "eager"),
}


def get_target(name: str) -> Target:
    """The target object; TargetUnavailable (one line) when its module cannot load."""
    from graphopt.registry import TARGETS

    module_name, attr = TARGETS[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and error.name.startswith("graphopt"):
            raise TargetUnavailable(f"target {name!r} is not part of this graphopt version yet") from error
        raise TargetUnavailable(
            f"target {name!r} needs the Python package {error.name!r}; install it with "
            f"pip install 'graphopt[{name}]'") from error
    return getattr(module, attr)


def resolve_target(config: Options) -> tuple[Target, list[str]]:
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
