"""What ``graphopt run MODEL --tp N`` prints: one table (or one JSON object) built in the
parent from every rank's row, so rank 0's view and the others' arrive together.

Only the CLI imports this module; the rest of graphopt.distributed prints nothing.
"""

from __future__ import annotations

from graphopt.cli.output import console, print_json, step, table
from graphopt.distributed.launch import BACKEND, DEFAULT_TIMEOUT_S
from graphopt.distributed.tp_run import run_tp

def _ranks(tp: int, timeout: float) -> str:
    """What --tp launches, as the progress line says it."""
    return f"{tp} {BACKEND} ranks on the CPU (1 thread each; a collective fails after {timeout:g} s)"


STYLE_HELP = "functional: plain local weights + functional all_reduce; dtensor: parallelize_module (DTensor weights)"


def run_tp_cmd(spec: str, tp: int, options: dict, batch: int, seq_len: int, seed: int, repeat: int,
               json_out: bool, style: str = "functional", timeout: float = DEFAULT_TIMEOUT_S) -> None:
    with step(f"running {spec} on {_ranks(tp, timeout)}", json_out):
        result = run_tp(spec, tp, seed, batch, seq_len, options, repeat=repeat, style=style, timeout=timeout)
    if json_out:
        print_json(result)
        return
    rows = [[r["rank"], r["target"], r["rel_err"], r["max_abs_err"], r["prefill_ms"],
             f"{100 * r['collective_share']:.0f}%" if r["collective_share"] is not None else "-",
             r["fused_all_reduce_norms"], r["all_reduces_left"],
             r["op_counts"].get("graphopt.qkv_proj", 0), r["op_counts"].get("graphopt.swiglu", 0),
             r["op_counts"].get("graphopt.attention", 0)] for r in result["ranks"]]
    console.print(table(
        f"graphopt run {result['model']} --tp {tp} ({style}, {BACKEND} on the CPU) vs the unsharded model",
        ["rank", "target", "relative error", "max abs error", "prefill ms", "in collectives",
         "all_reduce+add+rms_norm", "all_reduce left", "qkv_proj", "swiglu", "attention"], rows))
    for r in result["ranks"][:1]:
        for note in r["notes"]:
            console.print(f"rank 0: {note}")
        for fb in r["fallbacks"]:
            console.print(f"[yellow]rank 0 fallback[/] {fb['where']}: {fb['reason']}")


def generate_tp_cmd(spec: str, tp: int, options: dict, batch: int, seq_len: int, seed: int, tokens: int,
                    json_out: bool, style: str = "functional", timeout: float = DEFAULT_TIMEOUT_S) -> None:
    from graphopt.distributed.tp_generate import generate_tp

    with step(f"decoding {tokens} tokens of {spec} on {_ranks(tp, timeout)} and unsharded", json_out):
        result = generate_tp(spec, tp, seed, batch, seq_len, tokens, options, style=style, timeout=timeout)
    if json_out:
        print_json(result)
        return
    rows = [[r["rank"], r["target"], "yes" if r["tokens_match_tp1"] else f"no: from token {r['first_mismatch']}",
             r["ms_per_token_median"], r["tp1_eager_ms_per_token_median"], r["fallback"] or "-"]
            for r in result["ranks"]]
    console.print(table(f"graphopt run {result['model']} --generate {tokens} --tp {tp} ({style}, {BACKEND} on the CPU)",
                        ["rank", "target", "tokens match TP=1", "ms/token (median)", "TP=1 eager ms/token",
                         "fallback"], rows))


def generate_text_tp_cmd(spec: str, tp: int, options: dict, prompts: list[str], encoded, stop, tokenizer,
                         max_new_tokens: int, json_out: bool, module=None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """``graphopt generate MODEL --tp N``: the tokenized prompts decode on N ranks (and
    unsharded, eagerly, on each: TP=1); rank 0's text, then one table of every rank."""
    from graphopt.distributed.shard import check_divisible
    from graphopt.distributed.tp_generate import Prompt, generate_tp

    if module is not None:
        check_divisible(module, tp)  # one line here, before N processes load the model
    prompt = Prompt(encoded["input_ids"], encoded.get("attention_mask"), stop)
    with step(f"generating on {_ranks(tp, timeout)} and unsharded", json_out):
        result = generate_tp(spec, tp, 0, 1, 1, max_new_tokens, options, prompt=prompt, timeout=timeout)
    first = result["ranks"][0]
    outputs = [{"prompt": p, "text": tokenizer.decode(ids, skip_special_tokens=True), "token_ids": ids}
               for p, ids in zip(prompts, first["token_ids"])]
    if json_out:
        print_json({"tp": tp, "backend": result["backend"], "style": result["style"], "target": first["target"],
                    "prefill_ms": first["prefill_ms"], "outputs": outputs, "tokens_match_tp1": result["tokens_match_tp1"], "ranks": result["ranks"]})
        return
    for item in outputs:
        console.print(item["prompt"] + item["text"], highlight=False, markup=False)
    rows = [[r["rank"], r["target"], "yes" if r["tokens_match_tp1"] else f"no: from token {r['first_mismatch']}",
             r["prefill_ms"], r["ms_per_token_median"], r["tp1_eager_ms_per_token_median"], r["fallback"] or "-"]
            for r in result["ranks"]]
    console.print(table(f"graphopt generate {result['model']} --tp {tp} ({result['style']}, {BACKEND} on the CPU), "
                        f"{max_new_tokens} new tokens at most",
                        ["rank", "target", "tokens match TP=1", "prefill ms", "ms/token (median)",
                         "TP=1 eager ms/token", "fallback"], rows))
    for note in first["notes"]:
        console.print(f"rank 0: {note}", highlight=False)
