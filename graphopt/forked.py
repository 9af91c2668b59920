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
"""

from __future__ import annotations

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
        self._child = context.Process(target=_child, args=(send, fn, args), daemon=True)
        self._child.start()
        send.close()

    def result(self) -> Any:
        if self._child is None:
            return self._fn(*self._args)
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


def _child(send, fn: Callable[..., Any], args: tuple) -> None:
    try:
        result = (True, fn(*args))
    except BaseException as error:  # noqa: BLE001  (everything goes back to the parent, in one line)
        lines = str(error).strip().splitlines()
        result = (False, (type(error).__name__, lines[0] if lines else type(error).__name__, traceback.format_exc()))
    send.send(result)
    send.close()
    os._exit(0)  # no atexit handlers or buffered output of the parent's run twice
