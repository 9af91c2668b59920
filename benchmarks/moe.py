"""Mixture-of-experts speed: prefill ms and decode ms/token of a small Mixtral-style and a
Qwen2-MoE-style model (transformers classes, seeded random weights) for eager, Inductor and
graphopt on each target here, fp32 and with INT4 experts.

    python benchmarks/moe.py                                  # both models, 128-token prompt, 32 new tokens
    python benchmarks/moe.py --models mixtral --new-tokens 8 --targets onnxruntime

Every row runs graphopt.generation's greedy loop at batch 1 (so the same timing for all):
eager is ``eager_generate`` (the model on its own growing cache), Inductor the same loop
with the model's forward under ``torch.compile`` (Inductor's default options, dynamic
shapes; a warm-up run compiles first), graphopt ``graphopt.generate`` with ``target`` and
``int4`` (its static-cache graphs; compilation is left out of the times and shown as
"setup s"). Prefill ms is the prompt's forward; decode ms/token the median step. "x eager"
is the row's time over eager's (< 1 is faster); "tokens =" whether its new tokens equal
eager's (INT4 is not expected to). With ``int4`` graphopt quantizes the experts (and every
other linear: graphopt's default INT4 recipe) and on ONNX Runtime runs them as ``QMoE``.
A script, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console

import graphopt
from graphopt.generation import Sampler, drive
from graphopt.generation.api import eager_generate
from graphopt.generation.runner import EagerRunner
from graphopt.targets import targets_to_compare

console = Console(stderr=True)

# Small configs in each family's proportions: Mixtral 8 experts, top 2, expert inter 2x
# hidden; Qwen2-MoE (Qwen1.5-MoE-A2.7B's ratios) top 4, expert inter hidden / 2 and a
# shared expert 4x that, behind a sigmoid gate. Sizes are whole groups of 32 (QMoE needs it).
COMMON = dict(vocab_size=2048, hidden_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
              max_position_embeddings=512)


def build(name: str):
    import transformers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if name == "mixtral":
            cfg = transformers.MixtralConfig(num_local_experts=8, num_experts_per_tok=2, intermediate_size=512, **COMMON)
            return "Mixtral-style (8 experts, top 2)", transformers.MixtralForCausalLM(cfg).eval()
        cfg = transformers.Qwen2MoeConfig(num_experts=8, num_experts_per_tok=4, moe_intermediate_size=128,
                                          shared_expert_intermediate_size=512, intermediate_size=512, **COMMON)
        return "Qwen2-MoE-style (8 experts, top 4, shared)", transformers.Qwen2MoeForCausalLM(cfg).eval()


def expert_bytes(model) -> int:
    """fp32 bytes of the routed experts' weights (what INT4 shrinks most)."""
    return sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)


def _row(out, setup_s: float, note: str = "") -> dict:
    return {"prefill_ms": out.prefill_ms, "ms": statistics.median(out.ms_per_token), "tokens": out.new_tokens,
            "setup_s": setup_s, "note": note}


def run_eager(model, ids, new: int) -> dict:
    return _row(eager_generate(model, ids, new), 0.0)


def run_inductor(model, ids, new: int) -> dict:
    runner = EagerRunner(model)
    runner.step_fn.model = torch.compile(model, dynamic=True)  # the same loop, Inductor's forward
    start = time.perf_counter()
    with torch.no_grad():
        drive([runner], ids, None, 3, [Sampler()])  # warm-up: compiles prefill and decode
        setup = time.perf_counter() - start
        out = drive([runner], ids, None, new, [Sampler()])[0]
    return _row(out, setup)


def run_graphopt(model, ids, new: int, target: str, int4: bool) -> dict:
    start = time.perf_counter()
    out = graphopt.generate(model, ids, new, options={"target": target, "int4": int4})
    note = out.fallback or "; ".join(out.notes)
    if out.target != target:
        note = f"ran on {out.target}: {note}"
    # wall: a fallback's time went to the build that failed; a reused runner's setup is 0
    return _row(out, time.perf_counter() - start if out.fallback else out.compile_s, note)


def int4_expert_bytes(model, ids) -> int | None:
    """Bytes of the INT4 expert weights as quantize_int4 recorded them (one compile, eager target)."""
    torch._dynamo.reset()
    graphopt.reset()
    compiled = torch.compile(model, backend="graphopt", options={"target": "eager", "int4": True})
    with torch.no_grad():
        compiled(ids[:, :8])
    total = 0
    for report in graphopt.reports():
        for p in report.passes:
            if p.name == "quantize_int4":
                total += sum(layer["bytes_after"] for layer in p.stats.get("layers", []) if ".experts." in layer["name"])
    return total or None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mixtral,qwen2_moe")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--targets", default=None, help="graphopt targets, comma list; default: eager + what auto picks")
    parser.add_argument("--no-inductor", action="store_true")
    parser.add_argument("--no-int4", action="store_true")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    targets = targets_to_compare(args.targets)
    cols = ("model", "runner", "prefill ms", "x eager", "decode ms/token", "x eager", "tokens =", "setup s", "note")
    lines = [f"MoE: {args.prompt_len}-token prompt, {args.new_tokens} new tokens, batch 1, {args.threads} threads", "",
             "| " + " | ".join(cols) + " |", "|" + "|".join("---" if c in ("model", "runner", "tokens =", "note")
                                                           else "---:" for c in cols) + "|"]
    for name in args.models.split(","):
        label, model = build(name)
        ids = torch.randint(3, model.config.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
        fp32 = expert_bytes(model)
        if not args.no_int4:
            q = int4_expert_bytes(model, ids)
            console.print(f"{label}: routed experts {fp32 / 2**20:.2f} MiB fp32"
                          + (f", {q / 2**20:.2f} MiB int4 ({q / fp32:.3f}x)" if q else ", int4: no expert quantized"))
        console.print(f"{label}: eager ...")
        ref = run_eager(model, ids, args.new_tokens)
        rows = [("eager (transformers)", ref)]
        runs = [] if args.no_inductor else [("inductor", lambda: run_inductor(model, ids, args.new_tokens))]
        for target in targets:
            for int4 in (False,) if args.no_int4 else (False, True):
                runs.append((f"graphopt {target}" + (" int4" if int4 else ""),
                             lambda target=target, int4=int4: run_graphopt(model, ids, args.new_tokens, target, int4)))
        for runner, run in runs:
            console.print(f"{label}: {runner} ...")
            try:
                rows.append((runner, run()))
            except Exception as error:  # one row, not the run: say why and go on
                console.print(f"{runner} failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
        for runner, r in rows:
            same = "yes" if torch.equal(r["tokens"], ref["tokens"]) else "no"
            row = (label, runner, f"{r['prefill_ms']:.1f}", f"{r['prefill_ms'] / ref['prefill_ms']:.2f}",
                   f"{r['ms']:.2f}", f"{r['ms'] / ref['ms']:.2f}", same, f"{r['setup_s']:.0f}", r.get("note", ""))
            lines.append("| " + " | ".join(row) + " |")
            console.print(" | ".join(row), highlight=False)  # as it comes: a run cut short keeps its rows
    print("\n".join(lines))  # a markdown table


if __name__ == "__main__":
    main()
