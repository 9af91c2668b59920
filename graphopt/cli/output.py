"""How the CLI talks: rich tables and progress on stderr for people, JSON on stdout for tools."""

from __future__ import annotations

import contextlib
import json
import math
import sys
from typing import Any, Iterator, Sequence

from rich.console import Console
from rich.table import Table

# Tables on stdout; wide when piped (rich would wrap at 80 columns and cramp them).
console = Console(width=None if sys.stdout.isatty() else 160)
status_console = Console(stderr=True)  # progress: stderr, so --json stays clean


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=_jsonable, allow_nan=True))


def _jsonable(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return str(value)


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    t = Table(title=title, title_justify="left")
    first = rows[0] if rows else []
    for i, col in enumerate(columns):
        numeric = i < len(first) and isinstance(first[i], (int, float)) and not isinstance(first[i], bool)
        t.add_column(col, justify="right" if numeric else "left")
    for row in rows:
        t.add_row(*[fmt(v) for v in row])
    return t


def fmt(value: Any) -> str:
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) < 1e-3 or abs(value) >= 1e5:
            return f"{value:.2e}"
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return "" if value is None else str(value)


@contextlib.contextmanager
def step(message: str, quiet: bool = False) -> Iterator[None]:
    """A spinner on stderr while a long step runs (silent under --json)."""
    if quiet or not sys.stderr.isatty():
        yield
        return
    with status_console.status(message):
        yield


def error_line(message: str) -> None:
    """One unwrapped line on stderr: what went wrong and the fix."""
    print(f"error: {message}", file=sys.stderr)
