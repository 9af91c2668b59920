"""``graphopt run MODEL``: compile with graphopt, check against eager, time both.

With ``--generate N`` it decodes N tokens instead: ``graphopt.generate`` (a compiled step
over a static KV cache) against the eager model with its own growing cache.
"""

from __future__ import annotations

import statistics
import time

import typer

from graphopt.cli.common import MODEL_HELP, load, parse_options, time_ms
from graphopt.cli.output import console, print_json, step, table
from graphopt.sources.model_kind import decodes


def run(
    model: str = typer.Argument(..., help=MODEL_HELP),
    target: str = typer.Option(None, "--target", "-t", help="auto | eager | onnxruntime | triton | tensorrt"),
    option: list[str] = typer.Option([], "--option", "-o", help="a backend option as key=value (repeatable); see `graphopt options`"),
    batch: int = typer.Option(1, help="batch size of the random inputs"),
    seq_len: int = typer.Option(16, "--seq-len", help="sequence length of the random inputs"),
    seed: int = typer.Option(0, help="seed for weights and inputs"),
    repeat: int = typer.Option(10, help="timed runs per side (the median is shown)"),
    generate: int = typer.Option(0, "--generate", help="decode N tokens greedily with graphopt.generate and compare "
                                 "with eager; JSON gets generate: {tokens_match_eager, compiles, ms_per_token}"),
    json_out: bool = typer.Option(False, "--json", help="print JSON: rel_err, max_abs_err, timings, reports"),
    tp: int = typer.Option(1, "--tp", help="tensor-parallel ranks (gloo processes on the CPU, 1 thread each); "
                           "compares each shard with the unsharded model"),
    tp_timeout: float = typer.Option(60.0, "--tp-timeout", help="seconds a --tp collective waits for the other "
                                     "ranks before the run fails, naming the rank and the collective"),
) -> None:
    """Compile MODEL with backend="graphopt", compare its output with eager, and time both.

    Example: graphopt run llama-tiny --target eager -o check_numerics=true
    Example: graphopt run llama-small --generate 256 --json
    """
    config = parse_options(option, target=target)
    if tp > 1:
        from graphopt.distributed.cli import generate_tp_cmd, run_tp_cmd

        if generate:
            generate_tp_cmd(model, tp, config.to_dict(), batch, seq_len, seed, generate, json_out, timeout=tp_timeout)
        else:
            run_tp_cmd(model, tp, config.to_dict(), batch, seq_len, seed, repeat, json_out, timeout=tp_timeout)
        return
    if generate:
        _run_generate(model, config, batch, seq_len, seed, generate, json_out)
        return
    import torch

    import graphopt
    from graphopt.numerics import compare

    with step(f"loading {model}", json_out):
        loaded = load(model, seed, batch, seq_len)
    module, inputs = loaded.module, loaded.example_inputs
    with torch.no_grad():
        expected = module(*inputs)

    graphopt.reset()
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="graphopt", options=config.to_dict())
    with step("compiling with graphopt", json_out), torch.no_grad():
        start = time.perf_counter()
        actual = compiled(*inputs)
        compile_s = time.perf_counter() - start
    eager_ms, graphopt_ms = time_ms([module, compiled], inputs, repeat)
    diff = compare(actual, expected)
    reports = graphopt.reports()
    targets = sorted({r.target for r in reports}) or ["eager"]
    result = {
        "model": loaded.name,
        "target": ",".join(targets),
        "rel_err": diff.rel,
        "max_abs_err": diff.max_abs,
        "eager_ms": eager_ms,
        "graphopt_ms": graphopt_ms,
        "speedup": eager_ms / graphopt_ms if graphopt_ms else None,
        "compile_s": compile_s,
        "graphs": len(reports),
        "builds": _builds(reports),
        "reports": [r.to_dict() for r in reports],
    }
    if json_out:
        print_json(result)
        return
    _print_human(result, reports)


def _print_human(result: dict, reports) -> None:
    console.print(table(
        f"graphopt run {result['model']}",
        ["target", "max abs error", "relative error", "eager ms", "graphopt ms", "speedup", "compile s"],
        [[result["target"], result["max_abs_err"], result["rel_err"], result["eager_ms"],
          result["graphopt_ms"], f"{result['speedup']:.2f}x", result["compile_s"]]]))
    fused: dict[str, int] = {}
    for r in reports:
        for op, n in r.fused_op_counts().items():
            fused[op] = fused.get(op, 0) + n
    if fused:
        console.print("fused ops: " + ", ".join(f"{op} x{n}" for op, n in fused.items()))
    if result["builds"]:
        console.print(f"builds: {len(result['builds'])} ({sum(b['seconds'] for b in result['builds']):.1f} s): "
                      + "; ".join(f"{b['what']} {b['shapes']}" for b in result["builds"]))
    for r in reports:
        for fb in r.fallbacks:
            console.print(f"[yellow]fallback[/] {fb['where']}: {fb['reason']}")
        if r.routing is not None:  # -o record_routing=true: every call so far, the timed runs too
            from graphopt.report import routing_table

            console.print(f"routing (graph {r.graph_index}):\n" + routing_table(r.to_dict()["routing"]), markup=False)


def _builds(reports) -> list[dict]:
    """Every export / session / kernel the targets built, each with its graph's index."""
    return [{**b, "graph": r.graph_index} for r in reports for b in r.builds]


def _no_reports_reason(target: str, out) -> str | None:
    """Why a --generate run has no compile reports (None when it has some)."""
    if getattr(out, "reports", None):
        return None
    if out.fallback and target != "eager":
        return f"it decoded eagerly ({out.fallback})"
    if target == "onnxruntime":
        return ("the onnxruntime decode loop exports its prefill and decode models ahead of time with "
                "`graphopt export --kv-cache`'s pipeline, not through torch.compile, so no graph has a "
                "compile report; its export time is generate.compile_s")
    return "no graph was compiled"


def _run_generate(spec: str, config, batch: int, seq_len: int, seed: int, tokens: int, json_out: bool) -> None:
    import torch

    import graphopt
    from graphopt.sources import load_model
    from graphopt.errors import GraphoptError
    from graphopt.generation import generate_with_reference

    if tokens < 1:
        raise GraphoptError(f"--generate needs at least 1 token, got {tokens}")
    with step(f"loading {spec}", json_out):
        loaded = load_model(spec, seed, batch=batch, seq_len=seq_len, single_output=False)
    if not decodes(loaded.module):
        raise GraphoptError(f"--generate needs a causal LM; {spec} is a {loaded.family} model")
    input_ids = loaded.example_inputs[0]
    graphopt.reset()
    with step(f"generating {tokens} tokens with graphopt (target {config.target}) and eagerly", json_out):
        out, ref = generate_with_reference(loaded.module, input_ids, tokens, options=config.to_dict())
    target = out.target  # the runner that decoded (auto resolved; eager after a fallback)
    steps = list(out.ms_per_token)
    early, late = _median(steps[7:24]), _median(steps[-16:])
    extra = {k: getattr(out, k, None) for k in ("prefill_compiles", "prefill_ms", "compile_s", "fallback", "cuda_graphs")}
    result = {
        "model": loaded.name,
        "target": target,
        "generate": {
            "tokens": tokens,
            "prompt_len": int(input_ids.shape[1]),
            "tokens_match_eager": bool(torch.equal(out.sequences, ref.sequences)),
            "first_mismatch": _first_mismatch(out.sequences, ref.sequences, int(input_ids.shape[1])),
            "compiles": out.compiles,
            "prefill_compiles": extra["prefill_compiles"],
            "ms_per_token": steps,
            "median_ms_steps_8_24": early,
            "median_ms_last_16_steps": late,
            "late_over_early": late / early if early and late else None,
            "eager_ms_per_token": ref.ms_per_token,
            "eager_median_ms": _median(ref.ms_per_token),
            "prefill_ms": extra["prefill_ms"],
            "compile_s": extra["compile_s"],
            "fallback": extra["fallback"],
            "cuda_graphs": extra["cuda_graphs"],
        },
        "reports": [r.to_dict() for r in getattr(out, "reports", [])],
        "builds": _builds(getattr(out, "reports", [])),
        "reports_note": _no_reports_reason(target, out),
    }
    if json_out:
        print_json(result)
        return
    g = result["generate"]
    console.print(table(
        f"graphopt run {loaded.name} --generate {tokens}",
        ["target", "tokens match eager", "decode compiles", "ms/token steps 8-24", "ms/token last 16",
         "eager ms/token", "compile s"],
        [[target, _match_text(g), g["compiles"], early, late, g["eager_median_ms"], g["compile_s"]]]))
    if g["fallback"]:
        console.print(f"[yellow]fallback[/] {g['fallback']}")
    if g["cuda_graphs"]:
        console.print(g["cuda_graphs"])


def _first_mismatch(tokens, reference, prompt_len: int) -> int | None:
    """1-based index of the first generated token that differs from eager's, over the batch;
    None when all agree. Greedy decoding diverges from there on, so later tokens say nothing."""
    differs = (tokens[:, prompt_len:] != reference[:, prompt_len:]).any(0).nonzero()
    return int(differs[0]) + 1 if len(differs) else None


def _match_text(g: dict) -> str:
    if g["tokens_match_eager"]:
        return "yes"
    return f"no: from token {g['first_mismatch']} of {g['tokens']}" if g["first_mismatch"] else "no"


def _median(values) -> float | None:
    return statistics.median(values) if values else None
