"""Sweep graphopt over transformers causal-LM families: generate, torch.compile and ONNX export.

graphopt's fusions, KV cache and generation claim to work on any model with the pattern. This
builds a tiny random-weight model of each family transformers offers (hidden 64, 2 layers, 4
heads, 2 KV heads where the family has GQA, vocab 256; eval, fp32, seed 0) and checks:

- gen-auto / gen-eager: ``graphopt.generate`` (target auto, then eager), 8 greedy tokens vs
  ``eager_generate`` and vs transformers' own ``model.generate``; a fallback is reported;
- compile: ``torch.compile(model, backend="graphopt")`` logits vs eager at two lengths;
- compile-pad: the same on a left-padded batch with its attention mask (every position);
- compile-gen: transformers' own ``model.generate`` with ``model.forward`` compiled by graphopt
  (dynamo's default), two prompts of different lengths: the tokens vs eager's, the builds, and
  no graph exported once per input shape;
- export: ``graphopt export CONFIG.json -o X.onnx --kv-cache --json`` (ORT vs eager inside).

A cell reads ``ok`` (with the fused ops) or the first line of the error / mismatch.

    GRAPHOPT_CACHE_DIR=off nice .venv/bin/python benchmarks/hf_breadth.py [--only gemma2] [--check export]
        [--save run.json] [--json]; --table run.json prints a saved run
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

os.environ.setdefault("GRAPHOPT_CACHE_DIR", "off")  # a sweep measures building, not reloading

BASE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=256, tie_word_embeddings=False)
NO_GQA = {**BASE, "num_key_value_heads": 4}  # families without GQA: as many KV heads as heads
# family -> config fields (each family's own names for the same sizes); "model_type" when the key is
# a variant ("mistral@window4").
FAMILIES: dict[str, dict] = {
    "llama": BASE,
    "mistral": {**BASE, "sliding_window": None},
    "qwen2": BASE,
    "qwen3": {**BASE, "head_dim": 16},
    "gemma": {**BASE, "head_dim": 16},
    "gemma2": {**BASE, "head_dim": 16, "sliding_window": 32, "query_pre_attn_scalar": 16},
    "gemma3_text": {**BASE, "head_dim": 16, "sliding_window": 32, "query_pre_attn_scalar": 16},
    "phi": {**NO_GQA, "partial_rotary_factor": 0.5},
    "phi3": {**BASE, "pad_token_id": 0},  # its default pad id 32000 is outside a 256-token vocab
    "olmo": BASE,
    "olmo2": BASE,
    "granite": BASE,
    "stablelm": {**NO_GQA, "partial_rotary_factor": 0.25},
    "gpt_neox": {**NO_GQA, "rotary_pct": 0.25},
    "gpt2": dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=256),
    "opt": dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
                max_position_embeddings=256, word_embed_proj_dim=64),
    "falcon": dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                   new_decoder_architecture=True, max_position_embeddings=256),
    "starcoder2": BASE,
    "cohere": BASE,
    "mixtral": {**BASE, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {**BASE, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                  "shared_expert_intermediate_size": 64},
    # A window shorter than prompt + new tokens (6 + 8), so it changes which keys each query sees.
    "mistral@window4": {**BASE, "model_type": "mistral", "sliding_window": 4},
    "gemma2@window4": {**BASE, "model_type": "gemma2", "head_dim": 16, "sliding_window": 4,
                       "query_pre_attn_scalar": 16},
    "gemma3_text@window4": {**BASE, "model_type": "gemma3_text", "head_dim": 16, "sliding_window": 4,
                            "query_pre_attn_scalar": 16},
    # Falcon-RW: ALiBi instead of rotary, its slopes computed in bfloat16 by the model itself.
    "falcon@alibi": dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, model_type="falcon",
                         multi_query=False, new_decoder_architecture=False, parallel_attn=False, alibi=True, bias=True,
                         max_position_embeddings=256),
    "qwen2@window4": {**BASE, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4,
                      "max_window_layers": 0},  # Qwen2 slides from layer max_window_layers on
}
CHECKS = ["gen-auto", "gen-eager", "compile", "compile-pad", "compile-gen", "export"]
NEW_TOKENS = 8


def first_line(text: str) -> str:
    text = str(text).strip()
    return text.splitlines()[0][:160] if text else "(empty)"


def model_type(family: str) -> str:
    return FAMILIES[family].get("model_type", family)


def fields(family: str) -> dict:
    return {k: v for k, v in FAMILIES[family].items() if k != "model_type"}


def build(family: str):
    import transformers

    config = transformers.AutoConfig.for_model(model_type(family), **fields(family))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval().float(), config


def fused(counts: dict) -> str:
    keep = {k.split("::")[-1].removeprefix("graphopt."): v for k, v in counts.items()
            if k.startswith(("graphopt.", "com.microsoft::")) and "kv_cache" not in k}
    return " ".join(f"{k}x{v}" for k, v in sorted(keep.items()))


def check_generate(model, ids, target: str, hf_tokens) -> tuple[bool, str, dict]:
    import graphopt
    from graphopt.generation import eager_generate

    options = None if target == "auto" else {"target": target}
    out = graphopt.generate(model, ids, NEW_TOKENS, options=options)
    ref = eager_generate(model, ids, NEW_TOKENS)
    counts: dict = {}
    for report in out.reports:
        for k, v in report.op_counts.items():
            counts[k] = max(counts.get(k, 0), v)
    detail = {"target": out.target, "fallback": out.fallback, "notes": out.notes, "op_counts": counts,
              "tokens": out.sequences.tolist(), "eager_tokens": ref.sequences.tolist()}
    if not torch.equal(ref.sequences, hf_tokens):
        return False, "eager_generate differs from model.generate", detail
    if out.fallback:
        return False, f"fallback: {first_line(out.fallback)}", detail
    if not torch.equal(out.sequences, ref.sequences):
        where = (out.sequences != ref.sequences).nonzero()[0].tolist()
        return False, f"tokens differ from eager at {where} ({out.target})", detail
    notes = f" (note: {first_line(out.notes[0])})" if out.notes else ""
    return True, f"ok {out.target} {fused(counts)}".strip() + notes, detail


def check_compile(model, lengths=(5, 9)) -> tuple[bool, str, dict]:
    import graphopt

    torch._dynamo.reset()
    graphopt.reset()
    compiled = torch.compile(model, backend="graphopt")
    errs = []
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n in lengths:
            ids = torch.randint(0, 256, (2, n), generator=gen)
            want = model(input_ids=ids, use_cache=False).logits
            got = compiled(input_ids=ids, use_cache=False).logits
            errs.append(((got - want).norm() / want.norm()).item())
    reports = graphopt.reports()
    fallbacks = [f"{f['where']}: {f['reason']}" for r in reports for f in r.fallbacks]
    counts: dict = {}
    for r in reports:
        for k, v in r.op_counts.items():
            counts[k] = max(counts.get(k, 0), v)
    detail = {"rel_err": errs, "fallbacks": fallbacks, "graphs": len(reports), "op_counts": counts,
              "targets": sorted({r.target for r in reports})}
    torch._dynamo.reset()
    if not all(e < 1e-4 for e in errs):
        return False, f"logits rel err {max(errs):.2g}", detail
    if fallbacks:
        return False, f"fallback {first_line(fallbacks[0])}", detail
    return True, f"ok err {max(errs):.0e} {fused(counts)}".strip(), detail


def check_compile_padded(model) -> tuple[bool, str, dict]:
    """The compiled forward of a left-padded batch (row 1 padded by 3) vs eager, all positions."""
    import graphopt

    torch._dynamo.reset()
    graphopt.reset()
    compiled = torch.compile(model, backend="graphopt")
    ids = torch.randint(1, 256, (2, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        got = compiled(input_ids=ids, attention_mask=mask).logits
    fallbacks = [f"{f['where']}: {f['reason']}" for r in graphopt.reports() for f in r.fallbacks]
    torch._dynamo.reset()
    err = ((got - want).norm() / want.norm()).item()
    detail = {"rel_err": err, "nan_rows": got.isnan().any(-1).any(-1).tolist(), "fallbacks": fallbacks}
    if not err < 1e-4:
        return False, f"logits rel err {err:.2g}, NaN rows {detail['nan_rows']}", detail
    if fallbacks:
        return False, f"fallback {first_line(fallbacks[0])}", detail
    return True, f"ok err {err:.0e}", detail


def check_compiled_generate(model, lengths=(5, 9)) -> tuple[bool, str, dict]:
    """``model.generate`` with the forward compiled by graphopt: tokens, builds, per-shape exports."""
    import graphopt

    def generate_each() -> list[torch.Tensor]:
        out = []
        with torch.no_grad():
            for n in lengths:
                ids = torch.randint(1, 256, (1, n), generator=torch.Generator().manual_seed(n))
                out.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                          min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                          pad_token_id=0))
        return out

    want = generate_each()
    torch._dynamo.reset()
    graphopt.reset()
    forward = model.forward
    model.forward = torch.compile(forward, backend="graphopt")
    try:
        got = generate_each()
    finally:
        model.forward = forward
    reports = graphopt.reports()
    torch._dynamo.reset()
    fallbacks = [f"{f['where']}: {f['reason']}" for r in reports for f in r.fallbacks]
    per_shape = [n for r in reports for n in r.notes if "per input shape" in n]
    builds = sum(len(r.builds) for r in reports)
    detail = {"graphs": len(reports), "builds": builds, "fallbacks": fallbacks, "per_shape": per_shape,
              "targets": sorted({r.target for r in reports})}
    if not all(torch.equal(a, b) for a, b in zip(want, got)):
        return False, "tokens differ from eager's model.generate", detail
    if fallbacks:
        return False, f"fallback {first_line(fallbacks[0])}", detail
    if per_shape:
        return False, f"{builds} builds: {first_line(per_shape[0])}", detail
    return True, f"ok {len(reports)} graphs, {builds} builds", detail


def check_export(family: str, folder: Path) -> tuple[bool, str, dict]:
    from typer.testing import CliRunner

    from graphopt.cli.main import app

    config = folder / f"{family}.json"
    config.write_text(json.dumps({"model_type": model_type(family), **fields(family)}))
    result = CliRunner().invoke(app, ["export", str(config), "-o", str(folder / f"{family}.onnx"), "--kv-cache",
                                      "--json", "--force"])
    if result.exit_code != 0 and not result.stdout.lstrip().startswith("{"):
        error = result.exception if result.exception and not isinstance(result.exception, SystemExit) else None
        text = f"{type(error).__name__}: {error}" if error else result.output
        return False, first_line(text), {"output": result.output[-2000:]}
    data = json.loads(result.stdout)
    counts: dict = {}
    for f in data["files"]:
        for k, v in f["fused_ops"].items():
            counts[k] = max(counts.get(k, 0), v)
    detail = {k: data.get(k) for k in ("ok", "fallbacks", "cached_attention", "attention_mask_kept")}
    detail["fused_ops"] = counts
    detail["rel_err"] = [row["rel_err"] for f in data["files"] for row in f["validation"]]
    if not data["ok"]:
        return False, f"not ok: rel err {max(detail['rel_err']):.2g}, tokens_equal " \
                      f"{data.get('generation', {}).get('tokens_equal')}", detail
    if data["fallbacks"]:
        fb = data["fallbacks"][0]
        return False, f"fallback {fb['where']}: {first_line(fb['reason'])}", detail
    kept = " (mask kept)" if data.get("attention_mask_kept") else ""
    return True, f"ok {fused(counts)}{kept}", detail


def run_family(family: str, folder: Path, checks: list[str] | None = None) -> dict:
    row: dict = {}
    try:
        model, _ = build(family)
    except Exception as error:  # a family this transformers cannot build from these fields
        return {c: {"ok": False, "text": f"build: {type(error).__name__}: {first_line(error)}"} for c in CHECKS}
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(3))
    try:
        with torch.no_grad():
            # No eos (it would stop or, with min_new_tokens, bend the logits); an explicit mask, since
            # transformers would take token 0 for padding otherwise.
            hf_tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                       do_sample=False, eos_token_id=None, pad_token_id=0)
    except Exception as error:  # transformers itself cannot run these sizes: a sweep bug, not graphopt's
        return {c: {"ok": False, "text": f"model.generate: {type(error).__name__}: {first_line(error)}"}
                for c in CHECKS}
    jobs = {"gen-auto": lambda: check_generate(model, ids, "auto", hf_tokens),
            "gen-eager": lambda: check_generate(model, ids, "eager", hf_tokens),
            "compile": lambda: check_compile(model),
            "compile-pad": lambda: check_compile_padded(model),
            "compile-gen": lambda: check_compiled_generate(model),
            "export": lambda: check_export(family, folder)}
    for name, job in jobs.items():
        if checks and name not in checks:
            continue
        start = time.perf_counter()
        try:
            ok, text, detail = job()
        except Exception as error:
            ok, text = False, f"{type(error).__name__}: {first_line(error)}"
            detail = {"traceback": traceback.format_exc()[-3000:]}
        row[name] = {"ok": ok, "text": text, "seconds": round(time.perf_counter() - start, 1), **detail}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", help="a family to run (repeatable)")
    parser.add_argument("--check", action="append", choices=CHECKS, help="run only this check (repeatable)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--save", metavar="JSON", help="merge each family's results into this file as it finishes")
    parser.add_argument("--table", metavar="JSON", help="print the table of an earlier --json run, run nothing")
    args = parser.parse_args()
    if args.table:
        saved = json.loads(Path(args.table).read_text())
        print_table(saved["results"], saved["missing"])
        return
    from transformers import CONFIG_MAPPING

    wanted = args.only or list(FAMILIES)
    unknown = [f for f in wanted if f not in FAMILIES]
    if unknown:
        sys.exit(f"unknown family {unknown}; choose from {', '.join(FAMILIES)}")
    missing = [f for f in wanted if model_type(f) not in CONFIG_MAPPING]
    warnings.filterwarnings("ignore")  # transformers' and torch's deprecation notes drown the table
    logging.getLogger("graphopt").setLevel(logging.ERROR)  # fallbacks show in the table, not as warnings
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in wanted:
            if family in missing:
                continue
            print(f"{family} ...", file=sys.stderr, flush=True)
            with contextlib.redirect_stdout(io.StringIO()):
                results[family] = run_family(family, Path(tmp), args.check)
            print("  " + " | ".join(f"{c}: {r['text']}" for c, r in results[family].items()), file=sys.stderr)
            if args.save:  # a long sweep keeps what it has if it is stopped
                saved = json.loads(Path(args.save).read_text()) if Path(args.save).exists() else {"results": {}}
                saved["results"][family] = {**saved["results"].get(family, {}), **results[family]}
                saved["missing"] = missing
                Path(args.save).write_text(json.dumps(saved, indent=1, default=str))
    if args.json:
        print(json.dumps({"missing": missing, "results": results}, indent=1, default=str))
        return
    print_table(results, missing)


def print_table(results: dict, missing: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="graphopt on transformers causal-LM families", title_justify="left")
    table.add_column("family")
    for c in CHECKS:
        table.add_column(c, overflow="fold")
    for family, row in results.items():
        table.add_row(family, *[("[green]" if row[c]["ok"] else "[red]") + row[c]["text"].replace("[", r"\[")
                                if c in row else "-" for c in CHECKS])
    console = Console(width=220)
    console.print(table)
    if missing:
        console.print(f"not in this transformers: {', '.join(missing)}")


if __name__ == "__main__":
    main()
