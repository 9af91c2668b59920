"""Weights on 2 MB pages: the ``graphopt`` command restarts itself once with glibc's malloc
asking the kernel for transparent huge pages.

Why: a decode step reads every weight once, and on 4 KB pages the TLB misses as often as the
kernels cross a page. ONNX Runtime's prepacked ``MatMulNBits`` weights (Qwen2.5-Coder-0.5B's
GGUF: 700 MB) are plain ``malloc`` memory, and where the kernel's THP mode is ``madvise`` (the
default of most distributions) malloc memory stays on 4 KB pages unless it is advised. With
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (glibc 2.35 and later) malloc advises every mapping it
makes: ``graphopt generate`` of that file decoded at 46 ms/token against 52 on 4 KB pages, at
the same peak memory (benchmarks/RESULTS.md, "GGUF decode on huge pages"). A warm run now maps
the weights ORT packed from a file (backends/onnxruntime/runtime/prepacked_copy.py), whose page
cache folios are large already, as llama.cpp's mapped GGUF is; huge pages still serve the first
run's session and every session that packs in memory.

Every thread allocates from the one main arena (``glibc.malloc.arena_max=1``): a warm run opens
its session in a thread while the tokenizer loads (onnxruntime/decoder/from_checkpoint.py), and
the session's buffers from a thread's own arena mostly stayed on 4 KB pages (52 ms/token, no
gain; with one arena 46-49). The export's first run took as long either way (27.2 s vs 27.4 s).

A tunable is read when a process starts, so the command line restarts itself with them set
(``exec``, about 80 ms, before anything heavy is imported); a library cannot, so Python
callers set them themselves (README). The restart is skipped where it cannot help: not glibc or
older than 2.35, THP mode ``always`` (already on) or ``never``, ``glibc.malloc.hugetlb`` already set, or
``GRAPHOPT_HUGE_PAGES=0``.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

HUGETLB = "glibc.malloc.hugetlb=1"
ONE_ARENA = "glibc.malloc.arena_max=1"
OPT_OUT = "GRAPHOPT_HUGE_PAGES"
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path = THP_MODE) -> str | None:
    """The kernel's THP mode (``always``, ``madvise`` or ``never``: the bracketed word), None if unknown."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def _glibc_has_tunable() -> bool:
    name, version = platform.libc_ver()
    if name != "glibc":
        return False
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (2, 35)


def restart_environment(environ: os._Environ | dict, mode: str | None) -> dict | None:
    """The environment to restart with, or None when a restart would not help."""
    if environ.get(OPT_OUT, "1") == "0" or mode != "madvise":
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in tunables or not _glibc_has_tunable():
        return None
    added = [HUGETLB] + ([ONE_ARENA] if "glibc.malloc.arena_max" not in tunables else [])
    return {**environ, "GLIBC_TUNABLES": ":".join([tunables] * bool(tunables) + added)}


def in_effect(environ: os._Environ | dict = os.environ, mode: str | None = None) -> bool:
    """Whether this process's malloc memory can be on huge pages (what ``--json`` reports)."""
    mode = thp_mode() if mode is None else mode
    return mode == "always" or (mode == "madvise" and HUGETLB in environ.get("GLIBC_TUNABLES", "").split(":"))


def restart_with_huge_pages() -> None:
    """Replace this process by the same command with the tunable set, where that helps; return
    otherwise (also when exec fails: the command then runs on 4 KB pages)."""
    if not sys.platform.startswith("linux"):
        return
    environ = restart_environment(os.environ, thp_mode())
    if environ is None:
        return
    argv = [sys.executable, *sys.orig_argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, argv, environ)
    except OSError:
        return
