"""Run a function in a forked child process and get its (small, picklable) result back.

Why: building a runtime from a checkpoint takes memory it never needs again (the traced
graphs, the exporter's objects, a tensor being converted), and a process does not hand freed
heap back to the system reliably. In a child, all of it goes when the child exits, so the
parent, which then opens the runtime on the file the child wrote, peaks at the runtime's own
size. A fork shares the parent's imported modules (no second import of torch) and its pages
until either side writes them.

The child returns its result through a pipe; an exception comes back as ``ForkedError`` with
the child's exception type and first line. Where fork is not available (Windows, or
``GRAPHOPT_NO_FORK=1``), the function runs in this process instead.

A fork copies memory but only the thread that forks, and two kinds of state that count on the
parent's other threads hung export children of long-lived test workers:
- GNU OpenMP's thread pool (libgomp: torch's and MKL's intra-op threads). The child's first
  parallel region waited at a barrier for pool threads it does not have, forever. So the parent
  releases its pool right before the fork (``omp_pause_resource_all``: its threads exit, a few
  ms; its next parallel region starts new ones), and the child starts a pool of its own, as
  wide as the parent's. A libgomp without that call (older than GCC 9) keeps its pool, and the
  child's torch then computes on one thread.
- Objects whose destructor waits for the parent's threads: an ONNX Runtime session destroyed
  in the child waited in ``pthread_cond_destroy`` for its thread pool's. The child freezes what
  it inherited out of the garbage collector's reach (``gc.freeze``), so a reference cycle the
  parent had not collected yet is not collected there; it goes, undestroyed, when the child
  exits. That does not cover a child that drops the last reference to such an object itself:
  a child's work should build what it needs rather than let go of the parent's.
"""

from __future__ import annotations

import ctypes
import gc
import multiprocessing
import os
import traceback
from typing import Any, Callable


class ForkedError(Exception):
    """The child raised: ``kind`` is its exception's type name, the message its first line."""

    def __init__(self, kind: str, message: str, details: str = "") -> None:
        super().__init__(message)
        self.kind, self.details = kind, details


def fork_available() -> bool:
    return "fork" in multiprocessing.get_all_start_methods() and os.environ.get("GRAPHOPT_NO_FORK") != "1"


def run_forked(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a forked child (in this process where fork is not available)."""
    return start_forked(fn, *args).result()


class Forked:
    """A child started by ``start_forked``; ``result()`` waits for its answer."""

    def __init__(self, fn: Callable[..., Any], args: tuple) -> None:
        self._fn, self._args, self._child, self._receive = fn, args, None, None
        if not fork_available():
            return  # runs in this process, when its result is asked for
        context = multiprocessing.get_context("fork")
        self._receive, send = context.Pipe(duplex=False)
        one_thread = not _release_openmp_pools()
        self._child = context.Process(target=_child, args=(send, fn, args, one_thread), daemon=True)
        self._child.start()
        send.close()

    def result(self, timeout: float | None = None) -> Any:
        """The child's answer; ``timeout`` seconds without one stops the child and raises
        ``ForkedError("TimeoutError", ...)``."""
        if self._child is None:
            return self._fn(*self._args)
        if timeout is not None and not self._receive.poll(timeout):
            self.cancel()
            raise ForkedError("TimeoutError", f"the child process did not answer in {timeout:g} s")
        try:
            ok, payload = self._receive.recv()
        except EOFError:  # the child died without a word (killed, out of memory)
            self._child.join()
            raise ForkedError("ChildDied", f"the child process exited with code {self._child.exitcode} before "
                              "answering") from None
        finally:
            self._receive.close()
        self._child.join()
        if ok:
            return payload
        raise ForkedError(*payload)

    def cancel(self) -> None:
        """Stop the child, whose answer nobody will read."""
        if self._child is not None and self._child.is_alive():
            self._child.terminate()
            self._child.join()
        if self._receive is not None:
            self._receive.close()


def start_forked(fn: Callable[..., Any], *args: Any) -> Forked:
    """``fn(*args)`` started in a forked child now, so that this process can do other work
    (another child's) on another core meanwhile; ``.result()`` waits for it."""
    return Forked(fn, args)


def _release_openmp_pools() -> bool:
    """End the OpenMP thread pool this thread started in every GNU OpenMP runtime loaded here,
    so that a child forked now starts its own; False where one cannot (its pool is kept)."""
    released = True
    for path in _loaded_libgomps():
        try:  # RTLD_NOLOAD: the runtime already in this process, never a second copy
            gomp = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            pause = gomp.omp_pause_resource_all
        except (OSError, AttributeError):  # not loaded after all, or older than OpenMP 5.0
            released = False
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        released = pause(2) == 0 and released  # omp_pause_hard: the pool's threads exit
    return released


def _loaded_libgomps() -> list[str]:
    """Paths of the GNU OpenMP runtimes mapped into this process (torch bundles its own)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(None, 5)[-1].strip() for line in maps if "libgomp" in line}
    except OSError:  # not Linux: macOS' LLVM OpenMP handles fork itself
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith("libgomp") and os.path.exists(p))


def _child(send, fn: Callable[..., Any], args: tuple, one_thread: bool = False) -> None:
    gc.freeze()  # what the parent left is never collected here (see the module's docstring)
    if one_thread:
        _one_thread()
    try:
        result = (True, fn(*args))
    except BaseException as error:  # noqa: BLE001  (everything goes back to the parent, in one line)
        lines = str(error).strip().splitlines()
        result = (False, (type(error).__name__, lines[0] if lines else type(error).__name__, traceback.format_exc()))
    send.send(result)
    send.close()
    os._exit(0)  # no atexit handlers or buffered output of the parent's run twice


def _one_thread() -> None:
    """The parent's OpenMP pool is still there: a child that computes on more than one thread
    would wait for it, so torch computes on this one (as torch's DataLoader workers do)."""
    import sys

    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
