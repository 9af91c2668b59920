"""Give the C heap's free memory back to the OS after a run that shrank ONNX Runtime's arena.

A dynamic session shrinks its arena after a run at new shapes (``bound_outputs.py``), but that
only frees the arena's blocks into glibc's heap. glibc returns memory to the OS from the top
of its heap alone, so free chunks below a live one stay resident. On llama-small, twelve calls
at twelve shapes ended with 150-400 MB of such free memory, and resident memory after the 12th
call was 1.05-1.13x that after the 2nd. A trim inside the run reaches what the arena freed;
what the caller frees later (the outputs) is kept out of the heap by ``bound_outputs.empty_output``.
Together: 1.014x in every run since (``benchmarks/dynamic_shapes.py``).

A trim costs 0.4-11 ms, so it runs only after the runs that shrink (a new shape), never after
a repeated one, and only after runs of 50 ms or more (``release_after_run``). It also runs
after each build (the export runs in a thread of its own, whose glibc arena keeps what the
export freed: 100-170 MB per llama-small build) and after a dynamic session takes over
another graph's (``reuse.py``).

``malloc_trim`` is glibc's; where the C library is another (musl) or cannot be loaded this is
a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # no glibc: nothing to trim with
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_heap() -> bool:
    """Return the heap's free pages to the OS; whether anything was released."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


# A trim costs about 0.4 ms even with little to free: 2% of a llama-small decode step (19 ms)
# through torch.compile, where every step is a new shape. After a run of 50 ms it is under 1%,
# and a run shorter than that leaves little behind for glibc to keep.
WORTH_IT_AFTER_S = 0.05


def release_after_run(run_seconds: float) -> bool:
    """``release_free_heap`` after a run that shrank the arena, if the run took long enough
    to have left memory worth a trim (``WORTH_IT_AFTER_S``)."""
    return release_free_heap() if run_seconds >= WORTH_IT_AFTER_S else False
