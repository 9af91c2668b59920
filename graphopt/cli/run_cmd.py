"""``graphopt run MODEL``: compile with graphopt, check against eager, time both."""

from __future__ import annotations

import time

import torch
import typer

import graphopt
from graphopt.cli.common import MODEL_HELP, load, parse_options, time_ms
from graphopt.cli.output import console, print_json, step, table
from graphopt.numerics import compare


def run(
    model: str = typer.Argument(..., help=MODEL_HELP),
    target: str = typer.Option(None, "--target", "-t", help="auto | eager | onnxruntime | triton | tensorrt"),
    option: list[str] = typer.Option([], "--option", "-o", help="a backend option as key=value (repeatable); see `graphopt options`"),
    batch: int = typer.Option(1, help="batch size of the random inputs"),
    seq_len: int = typer.Option(16, "--seq-len", help="sequence length of the random inputs"),
    seed: int = typer.Option(0, help="seed for weights and inputs"),
    repeat: int = typer.Option(10, help="timed runs per side (the median is shown)"),
    json_out: bool = typer.Option(False, "--json", help="print JSON: rel_err, max_abs_err, timings, reports"),
) -> None:
    """Compile MODEL with backend="graphopt", compare its output with eager, and time both.

    Example: graphopt run llama-tiny --target eager -o check_numerics=true
    """
    config = parse_options(option, target=target)
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
    for r in reports:
        for fb in r.fallbacks:
            console.print(f"[yellow]fallback[/] {fb['where']}: {fb['reason']}")
