"""Decode ms/token at steps 16, 128, 512 and 1024: eager's growing cache vs graphopt's static cache (fp32 and int8 KV).

    python benchmarks/decode_cache.py [--model llama-small] [--tokens 1025] [--prompt 16]
                                      [--layout bhsd|bshd|paged] [--kv-dtypes auto,int8] [--target eager]
                                      [--check-steps 32]

Eager decoding (the model's own dynamic cache) concatenates the new K/V onto its cache every
step, so each step copies the whole cache, and its GQA repeat_kv copies it once more per
query-head group. graphopt.generate compiles one step over a static cache of max_length =
prompt + tokens positions written in place, and its attention (graphopt.cache_attention)
reads only the positions written so far, int8 as int8: step t costs O(t), not O(max_length).

Each figure is the median over a window of steps centred on the step named, the graphopt and
eager loops running in lockstep (these machines are shared: single steps are noisy, and
taking turns gives both the same noise). Compilation is printed apart and excluded.

KV bytes per step are counted from the cache shapes at the step's valid length n (prompt +
step), over every layer's K and V: what the attention op reads (eager: the repeat_kv copy of
Hq heads it hands SDPA; graphopt: Hkv heads as stored, int8 with one fp32 scale per token and
head). Eager's cat also copies its whole cache every step; that is not counted.

``--check-steps N`` compares int8 KV with fp32 KV: greedy tokens of the first N steps, and
the logits error when both decode the fp32 run's tokens (teacher forcing).
The onnxruntime target has no column: its static-cache runner is another change's work.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from graphopt import models
from graphopt.config import Options
from graphopt.generation import generate, generate_with_reference

STEPS = (16, 128, 512, 1024)


def window_median(ms: list[float], step: int, half: int) -> float | None:
    """Median ms of decode steps step-half .. step+half (1-based), clipped to the run."""
    lo, hi = max(1, step - half), min(len(ms), step + half)
    return statistics.median(ms[lo - 1:hi]) if lo <= hi and step <= len(ms) else None


def kv_bytes(config, length: int, kv_dtype: str, heads: int | None = None) -> int:
    """Bytes of every layer's K and V at ``length`` positions over ``heads`` heads (default: KV heads)."""
    heads = heads or config.num_kv_heads
    per_row = config.head_dim * (1 if kv_dtype == "int8" else 4) + (4 if kv_dtype == "int8" else 0)
    return 2 * config.num_layers * heads * length * per_row


def options(args, kv_dtype: str) -> dict:
    return {"target": args.target,
            "pass_options": {"static_kv_cache": {"layout": args.layout, "kv_dtype": kv_dtype}}}


def int8_check(model, prompt, steps: int, args) -> str:
    """Greedy tokens of int8 vs fp32 KV over ``steps``, and the logits error on fp32's tokens."""
    from graphopt.generation.static import StaticRunner

    fp32 = generate(model, prompt, steps, options=options(args, "auto"))
    int8 = generate(model, prompt, steps, options=options(args, "int8"))
    same = torch.equal(fp32.sequences, int8.sequences)
    runners = [StaticRunner(model, Options.parse(options(args, kv)), prompt.shape[1] + steps, args.target)
               for kv in ("auto", "int8")]
    worst, top1 = 0.0, 0
    with torch.no_grad():
        logits = []
        for r in runners:
            r.prepare(prompt, None)
            logits.append(r.prefill(prompt, None))
        for i in range(steps):
            ref, got = logits
            worst = max(worst, ((got - ref).abs().max() / ref.abs().max()).item())
            top1 += int(torch.equal(got.argmax(-1), ref.argmax(-1)))
            token = fp32.sequences[:, prompt.shape[1] + i:prompt.shape[1] + i + 1]
            if i + 1 == steps:
                break
            logits = []
            for r in runners:
                r.prepare_step(token, prompt.shape[1] + i)
                logits.append(r.step(token, prompt.shape[1] + i))
    return (f"int8 KV vs fp32 KV over {steps} steps: greedy tokens equal: {same}; on fp32's tokens, "
            f"max |logits error| / max |logits| = {worst:.2e}, same argmax at {top1}/{steps} steps")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-small", help="a built-in Llama (graphopt models)")
    parser.add_argument("--tokens", type=int, default=max(STEPS) + 1, help="new tokens (decode steps + 1)")
    parser.add_argument("--prompt", type=int, default=16, help="prompt length")
    parser.add_argument("--layout", default="bhsd", choices=("bhsd", "bshd", "paged"))
    parser.add_argument("--kv-dtypes", default="auto,int8", help="comma-separated static cache dtypes: auto, int8")
    parser.add_argument("--target", default="eager")
    parser.add_argument("--window", type=int, default=4, help="steps either side of each step in its median")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--check-steps", type=int, default=0, help="compare int8 with fp32 KV over N steps first")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kv_dtypes = [k for k in args.kv_dtypes.split(",") if k]
    bad = [k for k in kv_dtypes if k not in ("auto", "int8")]
    if bad:
        parser.error(f"--kv-dtypes {','.join(bad)}: each must be auto or int8")

    model = models.build(args.model, seed=args.seed)
    config = model.config
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    print(f"{args.model}: prompt {args.prompt}, {args.tokens} new tokens, {torch.get_num_threads()} threads, "
          f"layout {args.layout}, target {args.target}", flush=True)
    if args.check_steps:
        print(int8_check(model, prompt, args.check_steps, args), flush=True)
    runs: dict[str, list[float]] = {}
    eager_runs: list[list[float]] = []
    for kv in kv_dtypes:
        out, ref = generate_with_reference(model, prompt, args.tokens, options=options(args, kv))
        if out.fallback:
            print(f"graphopt ({kv} KV) fell back to eager: {out.fallback}")
        print(f"graphopt {kv} KV: {out.compiles} decode compilation(s), compile {out.compile_s:.1f} s (excluded); "
              f"tokens equal eager greedy: {torch.equal(out.sequences, ref.sequences)}", flush=True)
        runs[kv] = out.ms_per_token
        eager_runs.append(ref.ms_per_token)
        medians = [(s, window_median(ref.ms_per_token, s, args.window), window_median(out.ms_per_token, s, args.window))
                   for s in STEPS]
        print("  " + "; ".join(f"step {s}: eager {e:.2f} ms, static {g:.2f} ms" for s, e, g in medians
                               if e is not None and g is not None), flush=True)  # before the next run, if any

    names = {"auto": "static fp32", "int8": "static int8"}
    head = f"{'step':>6} {'eager dynamic ms':>17}" + "".join(f" {names[k] + ' ms':>16}" for k in runs)
    head += f" {'KV MB eager':>12}" + "".join(f" {'KV MB ' + names[k][7:]:>12}" for k in runs)
    print(head)
    for step in STEPS:
        eager = [window_median(ms, step, args.window) for ms in eager_runs]
        ours = [window_median(ms, step, args.window) for ms in runs.values()]
        if any(v is None for v in eager + ours):
            print(f"{step:>6} (run shorter than this step)")
            continue
        n = args.prompt + step
        row = f"{step:>6} {statistics.median(eager):>17.2f}" + "".join(f" {v:>16.2f}" for v in ours)
        row += f" {kv_bytes(config, n, 'auto', config.num_heads) / 1e6:>12.2f}"
        row += "".join(f" {kv_bytes(config, n, k) / 1e6:>12.2f}" for k in runs)
        print(row, flush=True)
    if "int8" in runs:
        per = kv_bytes(config, 1, "int8") / kv_bytes(config, 1, "auto")
        print(f"int8 KV reads {per:.3f}x the bytes of fp32 KV per step (int8 values plus one fp32 scale per token "
              "and head)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
