"""Twelve calls at twelve shapes through one torch.compile: time, builds and memory per call.

    python benchmarks/dynamic_shapes.py [--model llama-small] [--variants eager,inductor,ort,graphopt-eager]
    python benchmarks/dynamic_shapes.py --variants eager,ort,ort-dynamic,inductor --passes 3

The first thing a user does with a compiled model is call it with prompts of different
lengths. Each variant runs in its own process (so resident memory is its own) and is called
12 times, at sequence lengths 8 .. 512 with batch 1 and 4 taking turns (batch and length both
change by the second call, so dynamo's automatic-dynamic recompile covers both axes):

- ``eager``: the model itself, after one warm-up call at another shape;
- ``inductor``: ``torch.compile(dynamic=True)``; ``inductor-default``: ``torch.compile`` with
  dynamo's default (static first compile, then automatic dynamic), as ``ort`` is;
- ``ort`` / ``graphopt-eager``: ``torch.compile(backend="graphopt")`` on the onnxruntime /
  eager target, dynamo's default (static first compile, then automatic dynamic);
- ``ort-dynamic``: the onnxruntime target with ``dynamic=True`` (symbolic from the first call);
- ``ort-oblivious``: the default compile with ``torch.fx.experimental._config.backed_size_oblivious
  = True``.

Dynamo never lets a dynamic size be 1 (its 0/1 specialization), so with the default a batch
of 1 after a dynamic batch is a third graph ("2 <= input_ids.size()[0]" fails), as it is for
Inductor; graphopt's onnxruntime target proves it the dynamic graph with the batch at 1 and
runs it on that graph's session (backends/onnxruntime/compile/reuse.py: a note, not a build); with ``dynamic=True`` the first graph keeps batch 1 static and the second has both
axes dynamic. ``backed_size_oblivious`` drops the 0/1 guard, so the dynamic graph serves batch 1
too (graphopt's passes add no guard of their own: tests/core/test_shape_guards.py).

Per call: wall time (compilation included: that is what the user waits for), the builds that
graphopt's reports hold so far (exports + sessions; inductor's own compiles are not counted),
resident memory after the call's outputs are dropped, and peak resident memory. The table
gives each time as a ratio to eager's for the same call. The onnxruntime target is done when
it has at most 2 builds, memory after call 12 within 10% of after call 2, and every call after
the 2nd at or below eager's time.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

LENGTHS = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def shapes(max_len: int = 512) -> list[tuple[int, int]]:
    """(batch, length) of each call; ``max_len`` below 512 scales the lengths (a small model)."""
    return [(1 if i % 2 == 0 else 4, max(2, seq * max_len // 512)) for i, seq in enumerate(LENGTHS)]


VARIANTS = ("eager", "ort", "ort-dynamic", "ort-oblivious", "graphopt-eager", "inductor", "inductor-default")


def rss_mb() -> tuple[float, float]:
    """(resident now, peak resident) in MB, from /proc (psutil when installed)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20, peak
    except ImportError:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024, peak
    return float("nan"), peak


def build_count() -> int:
    import graphopt

    return sum(len(r.builds) for r in graphopt.reports())


def run_variant(name: str, model_name: str, max_len: int, passes: int = 1, repeat_longest: int = 0) -> list[dict]:
    """Call the model at every shape under ``name``; one row per call."""
    import graphopt
    from graphopt import models

    model = models.build(model_name)
    if name == "eager":
        fn = model
        with torch.no_grad():
            fn(*models.example_inputs(model, batch=2, seq_len=4))  # warm-up at a shape not timed
    elif name.startswith("inductor"):
        fn = torch.compile(model, dynamic=True if name == "inductor" else None)
    else:
        target = "eager" if name == "graphopt-eager" else "onnxruntime"
        if name == "ort-oblivious":
            from torch.fx.experimental import _config as fx_config

            fx_config.backed_size_oblivious = True
        fn = torch.compile(model, backend="graphopt", options={"target": target}, dynamic=name == "ort-dynamic" or None)
    rows = []
    for batch, seq in shapes(max_len):
        seconds = _timed_call(fn, model, batch, seq)
        now, peak = rss_mb()
        rows.append({"batch": batch, "seq": seq, "s": seconds, "builds": build_count(), "rss_mb": now,
                     "peak_mb": peak})
    for _ in range(passes - 1):  # the same 12 calls again: no compilation, the least disturbed time
        for row in rows:
            seconds = _timed_call(fn, model, row["batch"], row["seq"])
            row["steady_s"] = min(row.get("steady_s", seconds), seconds)
    if passes > 1:
        rows[-1]["builds_after_passes"] = build_count()
    # The longest shape again and again, as a server at one shape calls it (after the passes,
    # whose last call is that shape too): what a session that keeps its memory for a repeated
    # shape gains (backends/onnxruntime/target.py::_runner).
    rows[-1]["repeat_s"] = [_timed_call(fn, model, rows[-1]["batch"], rows[-1]["seq"]) for _ in range(repeat_longest)]
    if name != "eager" and not name.startswith("inductor"):
        rows[-1]["builds_detail"] = [b for r in graphopt.reports() for b in r.to_dict()["builds"]]
        rows[-1]["targets"] = sorted({r.target for r in graphopt.reports()})
    return rows


def _timed_call(fn, model, batch: int, seq: int) -> float:
    """Seconds of one call at (batch, seq); its output is dropped before memory is read."""
    from graphopt import models

    (ids,) = models.example_inputs(model, batch=batch, seq_len=seq, seed=seq)
    with torch.no_grad():
        start = time.perf_counter()
        out = fn(ids)
        seconds = time.perf_counter() - start
    del out
    gc.collect()
    return seconds


def table(results: dict[str, list[dict]], calls: list[tuple[int, int]]) -> str:
    eager = results.get("eager")
    names = [n for n in results if n != "eager"]
    steady = [n for n in names if "steady_s" in results[n][0]]
    head = ["call", "shape", "eager s"] + [f"{n} s (x eager)" for n in names] + \
        [f"{n} steady (x eager steady)" for n in steady] + \
        [f"{n} builds" for n in names if not n.startswith("inductor")] + [f"{n} RSS/peak MB" for n in results]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, (batch, seq) in enumerate(calls):
        base = eager[i]["s"] if eager else None
        cells = [str(i + 1), f"{batch}x{seq}", f"{base:.3f}" if base else "-"]
        for n in names:
            s = results[n][i]["s"]
            cells.append(f"{s:.3f} ({s / base:.2f})" if base else f"{s:.3f}")
        cells += [_steady(results, n, i) for n in names if "steady_s" in results[n][i]]
        cells += [str(results[n][i]["builds"]) for n in names if not n.startswith("inductor")]
        cells += [f"{results[n][i]['rss_mb']:.0f}/{results[n][i]['peak_mb']:.0f}" for n in results]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _steady(results: dict[str, list[dict]], name: str, i: int) -> str:
    s, base = results[name][i]["steady_s"], results.get("eager", [{}] * (i + 1))[i].get("steady_s")
    return f"{s:.3f} ({s / base:.2f})" if base else f"{s:.3f}"


def verdict(results: dict[str, list[dict]]) -> str:
    eager = results.get("eager")
    lines = []
    for name in ("ort", "ort-dynamic", "ort-oblivious"):
        ort = results.get(name)
        if not ort or not eager:
            continue
        builds = ort[-1]["builds"]
        memory = ort[-1]["rss_mb"] / ort[1]["rss_mb"]
        slower = [i + 1 for i in range(2, len(ort)) if ort[i]["s"] > eager[i]["s"]]
        line = (f"{name}: {builds} builds (done: <= 2); RSS after call 12 / after call 2 = {memory:.3f} "
                f"(done: <= 1.10); calls after the 2nd slower than eager: {slower or 'none'}")
        if "steady_s" in ort[0] and "steady_s" in eager[0]:
            steady = [i + 1 for i in range(2, len(ort)) if ort[i]["steady_s"] > eager[i]["steady_s"]]
            line += (f"; in the repeated passes (best of each): {steady or 'none'}, builds after them "
                     f"{ort[-1].get('builds_after_passes')}")
        lines.append(line)
    repeats = {name: rows[-1]["repeat_s"][1:] for name, rows in results.items() if len(rows[-1].get("repeat_s", [])) > 1}
    if "eager" in repeats:
        base = statistics.median(repeats["eager"])
        shape = f"{eager[-1]['batch']}x{eager[-1]['seq']}"
        for name, times in repeats.items():
            lines.append(f"{name}: {shape} repeated, median of calls 3..{len(times) + 2} in a row: "
                         f"{statistics.median(times):.3f} s ({statistics.median(times) / base:.2f}x eager)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-small")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated: " + ", ".join(VARIANTS))
    parser.add_argument("--max-len", type=int, default=512, help="longest call (scales all 12; for small models)")
    parser.add_argument("--passes", type=int, default=1,
                        help="run the 12 calls this many times in each process; passes after the first add a "
                             "'steady' column (best time per call: no compilation, least disturbed by load)")
    parser.add_argument("--repeat-longest", type=int, default=0,
                        help="then call the longest shape this many more times in a row and print the median of "
                             "all but the first of them, as a ratio to eager's (a server at one shape)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # run one variant in this process, print JSON
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_variant(args.one, args.model, args.max_len, args.passes, args.repeat_longest)))
        return 0
    results = {}
    for name in args.variants.split(","):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, __file__, "--model", args.model, "--max-len", str(args.max_len),
                               "--passes", str(args.passes), "--repeat-longest", str(args.repeat_longest),
                               "--one", name],
                              capture_output=True, text=True)
        if done.returncode:
            print(f"{name} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
            continue
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{name}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    print(table(results, shapes(args.max_len)))
    if "ort" in results:
        print("ort builds:", json.dumps(results["ort"][-1].get("builds_detail"), default=str))
    print(verdict(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
