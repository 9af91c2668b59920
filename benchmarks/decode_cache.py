"""Decode ms/token at steps 16, 128 and 512: eager with its growing cache vs graphopt's static cache.

    python benchmarks/decode_cache.py [--model llama-small] [--tokens 512] [--prompt 16]
                                      [--layout bhsd|bshd|paged] [--kv-dtype auto|int8] [--target eager]

Eager decoding concatenates the new K/V onto its cache every step, so each step copies the
whole cache and attends over a longer one. graphopt.generate compiles one step over a cache
of max_length = prompt + tokens positions, written in place: its cost stays flat (it attends
over all max_length positions, masked, from the first step on). Each figure is the median
over a window of steps centred on the step named, the two loops running in lockstep (these
machines are shared: single steps are noisy, and taking turns gives both the same noise).
Compilation time is printed apart and excluded from every step.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from graphopt import models
from graphopt.generation import generate_with_reference

STEPS = (16, 128, 512)


def window_median(ms: list[float], step: int, half: int) -> float | None:
    """Median ms of decode steps step-half .. step+half (1-based), clipped to the run."""
    lo, hi = max(1, step - half), min(len(ms), step + half)
    return statistics.median(ms[lo - 1:hi]) if lo <= hi and step <= len(ms) else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-small", help="a built-in Llama (graphopt models)")
    parser.add_argument("--tokens", type=int, default=max(STEPS) + 1, help="new tokens (decode steps + 1)")
    parser.add_argument("--prompt", type=int, default=16, help="prompt length")
    parser.add_argument("--layout", default="bhsd", choices=("bhsd", "bshd", "paged"))
    parser.add_argument("--kv-dtype", default="auto", choices=("auto", "int8"))
    parser.add_argument("--target", default="eager")
    parser.add_argument("--window", type=int, default=4, help="steps either side of each step in its median")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model = models.build(args.model, seed=args.seed)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    print(f"{args.model}: prompt {args.prompt}, {args.tokens} new tokens, {torch.get_num_threads()} threads, "
          f"layout {args.layout}, kv {args.kv_dtype}, target {args.target}", flush=True)
    options = {"target": args.target,
               "pass_options": {"static_kv_cache": {"layout": args.layout, "kv_dtype": args.kv_dtype}}}
    # The two loops take turns step by step, so a noisy neighbour slows both alike.
    out, ref = generate_with_reference(model, prompt, args.tokens, options=options)
    if out.fallback:
        print(f"graphopt fell back to eager: {out.fallback}")
    print(f"graphopt: {out.compiles} decode compilation(s), compile {out.compile_s:.1f} s (excluded below); "
          f"tokens equal eager greedy: {torch.equal(out.sequences, ref.sequences)}")
    print(f"{'step':>6} {'eager dynamic ms':>18} {'graphopt static ms':>20} {'speedup':>8}")
    for step in STEPS:
        e, g = window_median(ref.ms_per_token, step, args.window), window_median(out.ms_per_token, step, args.window)
        if e is None or g is None:
            print(f"{step:>6} {'(run shorter than this step)':>40}")
            continue
        print(f"{step:>6} {e:>18.2f} {g:>20.2f} {e / g:>7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
