"""``graphopt kernels``: list graphopt's Triton kernels and build them for GPU architectures.

Builds run ahead of time (``backends/triton/aot.py``), so no GPU is needed: NVIDIA
sm_80 / sm_90 produce PTX and a cubin, AMD gfx90a / gfx942 amdgcn and a hsaco. Each
(kernel, arch) reports whether it built (or the error), registers, shared memory and
spills where the compiler reports them, and two load facts read from the PTX / amdgcn:
``global_load_bits`` (the widest global load; 128 is a full vector) and ``async_copies``
(cp.async / direct-to-LDS copies, the asynchronous prefetch), and ``int_to_float_converts``
(integer-to-float convert instructions, which run at a fraction of the FMA rate: one per
element bounds a dequantizing kernel). ``variants`` lists the same numbers for each
compiled function (a spec or, with ``--tuning``, a config); the row's ``global_load_bits``
is the narrowest variant's, ``async_copies`` and ``int_to_float_converts`` their sums.
"""

from __future__ import annotations

import os
import sys

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from graphopt.cli.output import console, error_line, print_json, status_console, table

JSON_FIELDS = ("kernel", "arch", "built", "error", "registers", "shared_memory", "spills", "global_load_bits",
               "async_copies")
VARIANT_FIELDS = ("label", "function", "registers", "shared_memory", "spills", "global_load_bits", "async_copies")
CONVERTS = "int_to_float_converts"  # read from each function's details (aot.py)


def kernels(
    arch: str = typer.Option("sm_80,sm_90,gfx90a,gfx942", "--arch", "-a",
                             help="comma-separated architectures to build for: sm_80, sm_90, gfx90a, gfx942"),
    kernel: str = typer.Option("", "--kernel", "-k", help="comma-separated kernel names (default: every kernel)"),
    tuning: bool = typer.Option(False, "--tuning", help="also build the tuned function once per autotune config"),
    cache_dir: str = typer.Option("", "--cache-dir",
                                  help="keep the PTX/cubin/amdgcn/hsaco here (default: a temp dir removed at exit)"),
    jobs: int = typer.Option(1, "--jobs", "-j", min=1, help="build in this many child processes"),
    json_out: bool = typer.Option(False, "--json", help="print a JSON list of {kernel, arch, built, error, "
                                  "registers, shared_memory, spills, global_load_bits, async_copies, "
                                  "int_to_float_converts, variants}"),
) -> None:
    """List the Triton kernels and build each for the asked GPU architectures, without a GPU.

    Example: graphopt kernels --arch sm_90,gfx942 --json
    Example: graphopt kernels --kernel flash_attention --tuning --cache-dir /tmp/kernels
    """
    from graphopt.backends import triton as triton_backend
    from graphopt.backends.triton.registry import KERNELS

    archs, names = _split(arch), _split(kernel) or list(KERNELS)
    from graphopt.backends.triton.aot import ARCHS  # imports no triton

    unknown = [a for a in archs if a not in ARCHS]
    if unknown or not archs:
        _fail(f"unknown arch {', '.join(map(repr, unknown)) or '(none given)'}; valid: {', '.join(ARCHS)}")
    unknown = [k for k in names if k not in KERNELS]
    if unknown:
        _fail(f"unknown kernel {', '.join(map(repr, unknown))}; valid: {', '.join(KERNELS)}")
    if not triton_backend.is_available():
        _fail("graphopt kernels needs the Python package 'triton': pip install 'graphopt[triton]'")

    results = _build(names, archs, tuning, cache_dir or None, jobs, show=not json_out and sys.stderr.isatty())
    rows = [_row(r) for r in results]
    if json_out:
        print_json(rows)
    else:
        _print_human(rows, KERNELS, cache_dir)
    if not all(r["built"] for r in rows):
        raise typer.Exit(1)


def _row(result) -> dict:
    row = {f: getattr(result, f) for f in JSON_FIELDS}
    row["variants"] = [{**{f: getattr(fb, "name" if f == "function" else f) for f in VARIANT_FIELDS},
                        CONVERTS: fb.details.get(CONVERTS)} for fb in result.functions]
    counts = [v[CONVERTS] for v in row["variants"] if v[CONVERTS] is not None]
    row[CONVERTS] = sum(counts) if counts else None
    return row


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _fail(message: str) -> None:
    error_line(message)
    raise typer.Exit(2)


def _build(names, archs, tuning, cache_dir, jobs, show):
    """Build every (kernel, arch), kernel-major, with a progress bar on stderr.

    In this process one pair at a time, so the bar moves per build; with ``--jobs`` or
    under TRITON_INTERPRET=1 (whose kernels cannot be compiled here) all at once in
    child processes.
    """
    from graphopt.backends.triton import aot

    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
    pairs = [(k, a) for k in names for a in archs]
    progress = Progress(TextColumn("building {task.fields[current]:<28}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=status_console, disable=not show, transient=True)
    with progress:
        task = progress.add_task("build", total=len(pairs), current="")
        if jobs > 1 or aot._interpreting():
            progress.update(task, current=f"{len(pairs)} builds in {jobs} processes")
            results = aot.build_all(archs, names, tuning=tuning, cache_dir=cache_dir,
                                    jobs=jobs if jobs > 1 else None)
            progress.update(task, completed=len(pairs))
            return results
        results = []
        for k, a in pairs:
            progress.update(task, current=f"{k} for {a}")
            results.append(aot.build(k, a, tuning=tuning, cache_dir=cache_dir))
            progress.advance(task)
        return results


def _print_human(rows: list[dict], kernels: dict, cache_dir: str) -> None:
    built = sum(r["built"] for r in rows)
    title = f"graphopt Triton kernels: {built} of {len(rows)} builds succeeded"
    console.print(table(title, ["kernel", "op", "arch", "built", "registers", "shared memory (B)", "spills (B)",
                                "load bits", "async copies", "int->float converts"],
                        [[r["kernel"], kernels[r["kernel"]].op, r["arch"], "yes" if r["built"] else "[red]no[/]",
                          r["registers"], r["shared_memory"], r["spills"], r["global_load_bits"],
                          r["async_copies"], r[CONVERTS]] for r in rows]))
    for r in rows:
        if not r["built"]:
            console.print(f"[red]failed[/] {r['kernel']} for {r['arch']}: {r['error']}", soft_wrap=True)
    if cache_dir:
        console.print(f"artifacts kept in {cache_dir}")
