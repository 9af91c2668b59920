"""Where graphopt keeps what it can reuse across processes (exported decoders, converted .gguf
files): ``$GRAPHOPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/graphopt``, else ``~/.cache/graphopt``;
``GRAPHOPT_CACHE_DIR=off`` (or ``0``, ``none``, empty) turns every such cache off."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch


def cache_root() -> Path | None:
    root = os.environ.get("GRAPHOPT_CACHE_DIR")
    if root is not None and root.strip().lower() in ("off", "0", "none", ""):
        return None
    return Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "graphopt"


def evict_lru(folder: Path, keep: Path, keep_bytes: int) -> None:
    """Remove ``folder``'s entries (sub-folders), least recently used first (by modification
    time: readers touch what they use), until it holds at most ``keep_bytes``; ``keep`` stays."""
    def size(entry: Path) -> int:
        return sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())

    entries = [p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".") and p != keep]
    sizes = {p: size(p) for p in entries}
    total = sum(sizes.values()) + (size(keep) if keep.exists() else 0)
    for entry in sorted(entries, key=lambda p: p.stat().st_mtime):
        if total <= keep_bytes:
            break
        shutil.rmtree(entry, ignore_errors=True)
        total -= sizes[entry]


def write_entry(final: Path, write: Callable[[Path], None]) -> str | None:
    """Make the folder ``final`` with ``write(staging)`` into a staging folder beside it, then one
    rename, so a reader never sees half an entry. If another process made it first, theirs
    stays (the same key means the same content). Returns None, or why nothing was kept: a
    cache that cannot be written (full disk, read-only home) must never fail the caller."""
    staging = None
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name[:8]}-", dir=final.parent))
        write(staging)
        try:
            staging.rename(final)
        except OSError:
            if not final.is_dir():
                raise
        return None
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    finally:
        if staging is not None and staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def package_version(name: str) -> str:
    """The installed version of ``name``, or "none": part of keys whose content a package shapes."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes as they lie (any dtype, bfloat16 too), for hashing its values into a key."""
    import torch

    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data
