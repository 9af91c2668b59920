"""Triton kernel builds as records in the report of the graph that launched them.

On a GPU, Triton compiles a kernel at its first launch with a new specialisation (dtypes,
constexprs, divisibility of pointers and sizes, the autotuner's config): that is a build the
user waits for, so like an ONNX export it belongs in ``report.builds``. Triton calls
``knobs.runtime.jit_cache_hook`` before such a compile and ``jit_post_compile_hook`` after it;
this module chains itself onto both (keeping any hook the user set) and, while a compiled
graph runs (:func:`running_for`), files each compile under that graph's report.

Sizes reach the kernels as run-time arguments, so a new sequence length builds nothing unless
it changes a specialisation (e.g. a size that was divisible by 16 and is no longer): those
builds are what the records show. In TRITON_INTERPRET=1 nothing is compiled and nothing is
recorded.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Iterator

from graphopt import report as reports

_started: dict[Any, float] = {}
_installed = False
_lock = threading.Lock()


def install() -> None:
    """Chain the two hooks once per process; a hook already set keeps running first."""
    global _installed
    from triton import knobs

    with _lock:
        if _installed:
            return
        before_cache, before_post = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook

        def cache_hook(**kwargs: Any) -> Any:
            result = before_cache(**kwargs) if before_cache else None
            on_compile_start(kwargs["key"])
            return result

        def post_compile_hook(**kwargs: Any) -> Any:
            result = before_post(**kwargs) if before_post else None
            on_compile_end(kwargs["key"], kwargs["fn"].name, kwargs["compile"])
            return result

        knobs.runtime.jit_cache_hook = cache_hook
        knobs.runtime.jit_post_compile_hook = post_compile_hook
        _installed = True


@contextlib.contextmanager
def running_for(report: reports.CompileReport | None) -> Iterator[None]:
    """Kernels compiled inside the block are builds of ``report``'s graph."""
    if report is None:
        yield
        return
    with reports.building_for(report):
        yield


def on_compile_start(key: Any) -> None:
    _started[_hashable(key)] = time.perf_counter()


def on_compile_end(key: Any, kernel: str, compile: dict) -> None:
    start = _started.pop(_hashable(key), None)
    seconds = time.perf_counter() - start if start is not None else 0.0
    constants = compile.get("constants") or {}
    reports.record_build(f"triton kernel {kernel}", [], [], seconds,
                         num_warps=compile.get("num_warps"), num_stages=compile.get("num_stages"),
                         constants={str(k): _plain(v) for k, v in constants.items()})


def _hashable(key: Any) -> Any:
    try:
        hash(key)
        return key
    except TypeError:
        return repr(key)


def _plain(value: Any) -> Any:
    return value if isinstance(value, (int, float, bool, str, type(None))) else str(value)
