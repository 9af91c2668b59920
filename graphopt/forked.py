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
    if not fork_available():
        return fn(*args)
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(send, fn, args), daemon=True)
    child.start()
    send.close()
    try:
        ok, payload = receive.recv()
    except EOFError:  # the child died without a word (killed, out of memory)
        child.join()
        raise ForkedError("ChildDied", f"the child process exited with code {child.exitcode} before answering") \
            from None
    finally:
        receive.close()
    child.join()
    if ok:
        return payload
    raise ForkedError(*payload)


def _child(send, fn: Callable[..., Any], args: tuple) -> None:
    try:
        result = (True, fn(*args))
    except BaseException as error:  # noqa: BLE001  (everything goes back to the parent, in one line)
        lines = str(error).strip().splitlines()
        result = (False, (type(error).__name__, lines[0] if lines else type(error).__name__, traceback.format_exc()))
    send.send(result)
    send.close()
    os._exit(0)  # no atexit handlers or buffered output of the parent's run twice
