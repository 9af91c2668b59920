"""Tensor parallelism on this machine: llama-small on 2 gloo ranks (1 thread each) against
the unsharded model on 1 rank with 2 threads, so both sides use the same 2 cores.

    python benchmarks/tensor_parallel.py                        # prompt 128, 16 new tokens
    python benchmarks/tensor_parallel.py --prompt-len 32 --new-tokens 8 --runners eager,graphopt-eager

Runners: ``eager`` is PyTorch without graphopt (the sharded model called as is, and
``eager_generate`` for decoding); ``graphopt-eager`` and ``graphopt-onnxruntime`` compile
with graphopt on that target (``torch.compile`` for prefill, ``graphopt.generate`` for
decoding). ONNX Runtime cannot run a collective: on 2 ranks its graphs keep the collectives
on eager, and where a decode step cannot be built for it, ``graphopt.generate`` decodes
eagerly and the "fallback" column says why.

Per runner and TP: prefill ms (median over --repeat runs of one --prompt-len prompt at
batch 1), decode ms/token (median step of a greedy decode of --new-tokens tokens, compile
and export left out), and the share of prefill in collectives: the profiler's CPU time inside
``_c10d_functional::all_reduce`` and ``wait_tensor`` (the wait is where a rank blocks on its
peer) over the wall time of 3 profiled prefill calls after the timed ones, and of decoding
over the steps of a second, profiled decode (see bench_rank). Rank 0's numbers; a script,
not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

RUNNERS = ("eager", "graphopt-eager", "graphopt-onnxruntime")
COLLECTIVE_EVENTS = ("_c10d_functional::all_reduce", "_c10d_functional::wait_tensor")


def _in_collectives_us(prof) -> float:
    return sum(e.cpu_time_total for e in prof.key_averages() if e.key in COLLECTIVE_EVENTS)


def _profiled(fn):
    """(collective µs, wall µs, fn's result) of one profiled call."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        out = fn()
        wall = (time.perf_counter() - start) * 1e6
    return _in_collectives_us(prof), wall, out


def bench_rank(rank: int, world: int, runner: str, prompt_len: int, new_tokens: int, repeat: int) -> dict:
    import graphopt
    from graphopt.cli.common import time_ms
    from graphopt.sources import load_model
    from graphopt.distributed.shard import shard_llama
    from graphopt.generation.api import eager_generate

    loaded = load_model("llama-small", seed=0, batch=1, seq_len=prompt_len, single_output=False)
    model, ids = loaded.module, loaded.example_inputs[0]
    if world > 1:
        shard_llama(model)
    options = {"target": runner.removeprefix("graphopt-")}
    row = {"runner": runner, "tp": world, "threads": torch.get_num_threads(), "fallback": None, "notes": []}

    # prefill: the logits of one prompt
    def logits(x):
        return model(x)[0]

    torch._dynamo.reset()
    graphopt.reset()
    fn = logits if runner == "eager" else torch.compile(logits, backend="graphopt", options=options)
    (row["prefill_ms"],) = time_ms([fn], (ids,), repeat)
    inside, wall, _ = _profiled(lambda: [fn(ids) for _ in range(3)])
    row["prefill_in_collectives"] = inside / wall
    reports = graphopt.reports()
    row["prefill_targets"] = ",".join(sorted({r.target for r in reports})) or "eager"
    row["prefill_fallbacks"] = [f"{fb['where']}: {fb['reason']}" for r in reports for fb in r.fallbacks]

    # decode: greedy, the median step
    torch._dynamo.reset()
    if runner == "eager":
        def decode():
            return eager_generate(model, ids, new_tokens)
    else:
        def decode():
            return graphopt.generate(model, ids, new_tokens, options=options)
    # graphopt.generate builds its step afresh each call (compilation left out of ms/token).
    out = decode()
    row["ms_per_token"] = statistics.median(out.ms_per_token)
    # The collective share of decoding, from a second, profiled call: only the collectives
    # that start inside its last sum(ms_per_token) count (the decode steps end the call), so
    # those of compilation, export and prefill stay out.
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled = decode()
    window_us = sum(profiled.ms_per_token) * 1e3
    events = [e for e in prof.events() if e.key in COLLECTIVE_EVENTS]
    end_us = max((e.time_range.end for e in prof.events()), default=0.0)
    inside = sum(e.cpu_time_total for e in events if e.time_range.start >= end_us - window_us)
    row["decode_in_collectives"] = inside / window_us if window_us else 0.0
    row["decode_target"] = getattr(out, "target", None) or "eager"
    row["fallback"] = getattr(out, "fallback", None)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--runners", default=",".join(RUNNERS))
    args = parser.parse_args()
    from graphopt.distributed.launch import spawn

    console = Console(width=200)  # a narrower table would cut the numbers
    rows = []
    for runner in args.runners.split(","):
        for world, threads in ((1, 2), (2, 1)):
            console.print(f"[dim]{runner}: TP={world}, {threads} thread(s) per rank[/]")
            try:
                rows.append(spawn(bench_rank, world, runner, args.prompt_len, args.new_tokens, args.repeat,
                                  threads=threads)[0])
            except Exception as error:  # noqa: BLE001  one runner failing leaves the others' rows
                rows.append({"runner": runner, "tp": world, "error": str(error).splitlines()[0]})
    table = Table(title=f"llama-small, prompt {args.prompt_len}, {args.new_tokens} new tokens, gloo, "
                        "TP=1 on 2 threads vs TP=2 on 1 thread per rank (rank 0)")
    for col in ("runner", "TP", "prefill ms", "prefill in collectives", "decode ms/token", "decode in collectives",
                "prefill target",
                "decode target", "fallback"):
        table.add_column(col)
    for r in rows:
        if "error" in r:
            table.add_row(r["runner"], str(r["tp"]), "-", "-", "-", "-", "-", "-", r["error"])
            continue
        table.add_row(r["runner"], str(r["tp"]), f"{r['prefill_ms']:.1f}", f"{100 * r['prefill_in_collectives']:.0f}%",
                      f"{r['ms_per_token']:.1f}", f"{100 * r['decode_in_collectives']:.0f}%", r["prefill_targets"],
                      r["decode_target"], (r["fallback"] or "-")[:80])
    console.print(table)
    for r in rows:
        for fb in r.get("prefill_fallbacks", []):
            console.print(f"{r['runner']} TP={r['tp']} prefill fallback: {fb}")


if __name__ == "__main__":
    main()
