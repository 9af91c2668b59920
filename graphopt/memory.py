"""Will a model fit? One line before anything is allocated, instead of the kernel's OOM killer
halfway through an export.

``available_bytes()`` is what this process may still take: the system's ``MemAvailable``, or
less when a cgroup (a container's memory limit) allows less. ``check_fits(needed, ...)``
raises ``MemoryNeeded`` naming what the model needs, what is available, and what would fit
(a checkpoint's own quantization, ``--int4``). ``GRAPHOPT_MEMORY_CHECK=off`` skips it.
"""

from __future__ import annotations

import os
from pathlib import Path

from graphopt.errors import GraphoptError

GB = 1 << 30
# What a graphopt process holds besides the weights when it decodes on ONNX Runtime: torch,
# onnxruntime and a tokenizer imported (~0.33 GB measured for Qwen2.5's 151k vocabulary),
# activations and the KV cache of a short prompt.
RUNTIME_BYTES = 400 << 20


class MemoryNeeded(GraphoptError):
    """The model does not fit in the memory available; the message says what would."""


def available_bytes() -> int | None:
    """Bytes this process may still allocate, or None where the system does not say."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    limit = _cgroup_room()
    if limit is not None:
        found.append(limit)
    return min(found) if found else None


def _cgroup_room() -> int | None:
    """cgroup v2's ``memory.max - memory.current`` for this process's group, when limited."""
    try:
        group = Path("/proc/self/cgroup").read_text().strip().split("::", 1)[-1]
        folder = Path("/sys/fs/cgroup") / group.lstrip("/")
        limit = (folder / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((folder / "memory.current").read_text().strip())
    except (OSError, ValueError):
        return None


def describe(n: int) -> str:
    return f"{n / GB:.1f} GB" if n >= GB // 10 else f"{n / (1 << 20):.0f} MB"


def check_fits(needed: int, what: str, alternatives: list[tuple[str, int]] = ()) -> None:
    """Raise MemoryNeeded when ``needed`` bytes (for ``what``) exceed what is available;
    ``alternatives``: (how, bytes it would need) the message offers when they fit."""
    if os.environ.get("GRAPHOPT_MEMORY_CHECK", "").lower() == "off":
        return
    room = available_bytes()
    if room is None or needed <= room:
        return
    fitting = [f"{how} (about {describe(size)})" for how, size in alternatives if size <= room]
    hint = ("; it would fit " + " or ".join(fitting)) if fitting else "; free memory or use a machine with more"
    raise MemoryNeeded(f"{what} needs about {describe(needed)} and {describe(room)} are available{hint} "
                       "(GRAPHOPT_MEMORY_CHECK=off to try anyway)")
