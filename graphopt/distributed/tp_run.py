"""``graphopt run MODEL --tp N``: each rank shards the model, compiles its shard with
graphopt, checks it against the unsharded model and times its prefill; the parent gathers
one row per rank.

Every rank builds the unsharded model from the same seed, so each holds the reference
itself and no tensor crosses ranks except through the model's own all-reduces.
"""

from __future__ import annotations

import time
from typing import Any

import torch

COLLECTIVE_EVENTS = ("_c10d_functional::all_reduce", "_c10d_functional::wait_tensor")
FUSED_COLLECTIVE = "graphopt.all_reduce_add_rms_norm"


def op_counts(reports) -> dict[str, int]:
    """Op counts summed over every graph this rank compiled."""
    counts: dict[str, int] = {}
    for r in reports:
        for op, n in r.op_counts.items():
            counts[op] = counts.get(op, 0) + n
    return counts


def collective_share(fn, inputs, runs: int = 3) -> float:
    """Share of ``fn``'s wall time spent inside the functional collectives (the all-reduce
    and the wait that blocks on the peers), from the profiler's CPU events."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(runs):
            fn(*inputs)
        wall_us = (time.perf_counter() - start) * 1e6
    inside = sum(e.cpu_time_total for e in prof.key_averages() if e.key in COLLECTIVE_EVENTS)
    return inside / wall_us if wall_us else 0.0


def rank_run(rank: int, world: int, spec: str, seed: int, batch: int, seq_len: int,
             options: dict, repeat: int, style: str) -> dict[str, Any]:
    """One rank's row: error against the unsharded model, op counts, prefill ms."""
    import graphopt
    from graphopt.cli.common import time_ms
    from graphopt.sources import load_model
    from graphopt.distributed.shard import shard_llama
    from graphopt.numerics import compare

    loaded = load_model(spec, seed=seed, batch=batch, seq_len=seq_len)
    module, inputs = loaded.module, loaded.example_inputs
    with torch.no_grad():
        expected = module(*inputs)
        shard_llama(module, style=style)
        graphopt.reset()
        torch._dynamo.reset()
        compiled = torch.compile(module, backend="graphopt", options=options)
        start = time.perf_counter()
        actual = compiled(*inputs)
        compile_s = time.perf_counter() - start
    # repeat=0: correctness only (tests), no timing runs
    (ms,) = time_ms([compiled], inputs, repeat) if repeat else (None,)
    share = collective_share(compiled, inputs) if repeat else None
    diff = compare(actual, expected)
    reports = graphopt.reports()
    counts = op_counts(reports)
    return {
        "rank": rank,
        "model": loaded.name,
        "target": ",".join(sorted({r.target for r in reports})) or "eager",
        "rel_err": diff.rel,
        "max_abs_err": diff.max_abs,
        "prefill_ms": ms,
        "collective_share": share,
        "compile_s": compile_s,
        "fused_all_reduce_norms": counts.get(FUSED_COLLECTIVE, 0),
        "all_reduces_left": counts.get("_c10d_functional.all_reduce", 0),
        "op_counts": counts,
        "fallbacks": [fb for r in reports for fb in r.fallbacks],
        "notes": [n for r in reports for n in r.notes],
    }


def run_tp(spec: str, world: int, seed: int, batch: int, seq_len: int, options: dict,
           repeat: int = 5, style: str = "functional", threads: int = 1,
           timeout: float | None = None) -> dict[str, Any]:
    """Launch ``world`` gloo ranks and gather their rows; ``timeout``: seconds a collective
    waits (the launcher's default when None)."""
    from graphopt.distributed.launch import BACKEND, DEFAULT_TIMEOUT_S, spawn

    rows = spawn(rank_run, world, spec, seed, batch, seq_len, options, repeat, style, threads=threads,
                 timeout=DEFAULT_TIMEOUT_S if timeout is None else timeout)
    return {
        "model": rows[0]["model"],
        "tp": world,
        "backend": BACKEND,
        "style": style,
        "rel_err": max(r["rel_err"] for r in rows),
        "ranks": rows,
    }
