"""``graphopt_triton::<op>``: one custom op per graphopt op that has a Triton kernel.

Each has the graphopt op's schema, argument for argument (mutation annotations
included, so ``kv_cache_update`` still declares that it writes its cache). Its
implementation calls the kernel's launcher (registry.lowering); its fake
implementation calls the graphopt op, whose own fake answers under a FakeTensorMode.
Being opaque custom ops, Inductor schedules them as extern calls around the code it
generates, and an eager GraphModule calls them like any op. (``torch.library.triton_op``
would let Inductor see the kernel launch, but it traces the launcher with fake tensors,
and ours do host-side work that needs real ones: choosing prefill or decode attention,
split counts, the reference fallback below.)

Inputs a kernel does not take (a float dtype other than fp16/bf16/fp32, or whatever its
launcher refuses with a ValueError: a row too long for one block, ...) run the graphopt
reference instead, so a graph lowered for Triton computes whatever the reference
computes. The first refusal per op and reason is logged; ``calls`` counts both kinds.

Registering needs torch only; triton is imported when a kernel first runs.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

import torch

import graphopt.ops  # noqa: F401  (registers the graphopt:: ops whose schemas are copied)
from graphopt.ops import OPS

from . import registry

NAMESPACE = "graphopt_triton"
# Floating dtypes the kernels compute in fp32 for; other floats (fp64) keep the reference.
KERNEL_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

log = logging.getLogger("graphopt")
_lock = threading.Lock()
_library: torch.library.Library | None = None
_defined: dict[str, torch._ops.OpOverload] = {}
_refusals: set[tuple[str, str]] = set()
# Python-side calls per (graphopt op, "kernel" | "reference"): what a lowered graph really
# ran. CUDA graph replays bypass Python and are not counted.
calls: Counter = Counter()


def triton_op(graphopt_op: str) -> torch._ops.OpOverload | None:
    """``torch.ops.graphopt_triton.<op>.default`` for ``"graphopt.<op>"``, defined on first
    use; None when no kernel implements the op."""
    if graphopt_op not in registry.lowered_ops():
        return None
    short = graphopt_op.split(".", 1)[1]
    with _lock:
        if short not in _defined:
            _defined[short] = _define(short)
        return _defined[short]


def _define(short: str) -> torch._ops.OpOverload:
    global _library
    if _library is None:
        _library = torch.library.Library(NAMESPACE, "DEF")  # kept alive: dropping it unregisters the ops
    reference = OPS[short].default
    schema = str(reference._schema).split("::", 1)[1]  # "rms_norm(Tensor x, ...) -> Tensor"
    _library.define(schema)
    launcher = registry.lowering(f"graphopt.{short}")

    def kernel(*args, **kwargs):
        reason = _unsupported(args, kwargs)
        if reason is None:
            try:
                result = launcher(*args, **kwargs)
            except ValueError as error:  # a shape or layout this kernel does not take
                reason = str(error)
            else:
                calls[(f"graphopt.{short}", "kernel")] += 1
                return result
        _note_refusal(short, reason)
        calls[(f"graphopt.{short}", "reference")] += 1
        return reference(*args, **kwargs)

    def fake(*args, **kwargs):
        return reference(*args, **kwargs)  # dispatches to the graphopt op's fake under FakeTensorMode

    # CompositeExplicitAutograd: one kernel for every device; the launcher decides what runs.
    _library.impl(short, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{short}", fake, lib=_library)
    return getattr(getattr(torch.ops, NAMESPACE), short).default


def _unsupported(args, kwargs) -> str | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype not in KERNEL_FLOAT_DTYPES:
            return f"{value.dtype} input (the kernels take fp16, bf16 and fp32)"
    return None


def _note_refusal(short: str, reason: str) -> None:
    key = (short, reason)
    if key not in _refusals:
        _refusals.add(key)
        log.info("graphopt: the Triton %s kernel does not take these inputs (%s); running the reference", short,
                 reason)
