"""``graphopt debug MODEL``: what each pass did, why a fusion did not fire, where numerics broke.

The switches are MLIR's pass instrumentation on FX graphs. The pipeline runs on the
exact ATen graphs the torch.compile backend would see (captured through dynamo).
"""

from __future__ import annotations

import sys

import typer

from graphopt.cli.common import MODEL_HELP, load, parse_options
from graphopt.cli.output import console, print_json, step, table
from graphopt.compiler import run_pipeline
from graphopt.frontend import capture_aten_graphs
from graphopt.instrument import NumericCheck, PrintIR
from graphopt.pipeline import pipeline_string


def debug(
    model: str = typer.Argument(..., help=MODEL_HELP),
    pipeline: str = typer.Option(None, "--pipeline", help='comma-separated passes to run instead of the default, e.g. "canonicalize,fuse_rms_norm"'),
    disable_pass: list[str] = typer.Option([], "--disable-pass", help="leave this pass out (repeatable)"),
    print_ir_before: list[str] = typer.Option([], "--print-ir-before", help="print the graph before PASS (repeatable)"),
    print_ir_after: list[str] = typer.Option([], "--print-ir-after", help="print the graph after PASS (repeatable)"),
    print_ir_after_all: bool = typer.Option(False, "--print-ir-after-all", help="print the graph after every pass"),
    print_ir_after_change: bool = typer.Option(False, "--print-ir-after-change", help="print the graph after each pass that changed it"),
    print_ir_after_failure: bool = typer.Option(False, "--print-ir-after-failure", help="print the graph a pass failed on"),
    diff: bool = typer.Option(False, "--diff", help="print each change as a unified diff instead of the whole graph"),
    timing: bool = typer.Option(False, "--timing", help="table of passes: wall time, nodes before/after, matches"),
    check_numerics: bool = typer.Option(False, "--check-numerics", help="run the graph after every pass and compare with the input graph"),
    tolerance: float = typer.Option(1e-4, "--tolerance", help="relative error that flags a pass in --check-numerics"),
    why: list[str] = typer.Option([], "--why", help="near misses of PASS: where matching stopped and why (repeatable)"),
    bisect_limit: int = typer.Option(-1, "--bisect-limit", help="allow only N rewrites in total (-1: all)"),
    seq_len: int = typer.Option(16, "--seq-len", help="sequence length of the random inputs"),
    seed: int = typer.Option(0, help="seed for weights and inputs"),
    json_out: bool = typer.Option(False, "--json", help="print everything as JSON"),
) -> None:
    """Run graphopt's pipeline on MODEL with pass instrumentation.

    Examples:
      graphopt debug llama-tiny --timing --check-numerics
      graphopt debug llama-tiny --why fuse_rms_norm
      graphopt debug llama-tiny --print-ir-after-change --diff
    """
    from graphopt.registry import get_pass

    for name in [*why, *print_ir_before, *print_ir_after, *disable_pass]:
        get_pass(name)  # unknown names fail now, with the list of known passes
    config = parse_options([], pipeline=pipeline, disable_passes=list(disable_pass) or None,
                           bisect_limit=bisect_limit, tolerance=tolerance, target="eager")
    with step(f"loading {model}", json_out):
        loaded = load(model, seed, 1, seq_len)
    with step("capturing ATen graphs", json_out):
        graphs = capture_aten_graphs(loaded.module, loaded.example_inputs, config)
    printer = PrintIR(print_ir_before, print_ir_after, print_ir_after_all, print_ir_after_change,
                      print_ir_after_failure, diff, stream=None if json_out else sys.stdout)
    results = []
    for index, graph in enumerate(graphs):
        instruments = [printer]
        checker = None
        if check_numerics and graph.example_inputs is not None:
            checker = NumericCheck(graph.example_inputs, tolerance)
            instruments.append(checker)
        result, ctx = run_pipeline(graph.gm, config, graph.example_inputs, instruments)
        results.append(_graph_result(index, result, checker, why))
    out = {"model": loaded.name, "pipeline": _pipeline_names(config), "graphs": results, "ir": printer.chunks}
    if json_out:
        print_json(out)
        return
    for g in results:
        _print_graph(g, timing or check_numerics, why)


def _pipeline_names(config) -> str:
    from graphopt.pipeline import build_pipeline

    return pipeline_string(build_pipeline(config.pipeline or None))


def _graph_result(index, result, checker, why) -> dict:
    wanted = {w.replace("-", "_") for w in why}
    return {
        "graph": index,
        "passes": [r.to_dict() for r in result.records],
        "near_misses": [m.to_dict() for m in result.near_misses if not wanted or m.pass_name in wanted],
        "first_bad_pass": checker.first_bad if checker else None,
        "rewrites": [r.to_dict() for r in result.rewrites],
    }


def _print_graph(g: dict, show_table: bool, why: list[str]) -> None:
    if show_table:
        rows = []
        for p in g["passes"]:
            num = p.get("numerics") or {}
            flag = "" if not num else ("ok" if num.get("ok") else "FAIL")
            rows.append([p["name"], p["status"], p["matches"], p["time_ms"], p["nodes_before"], p["nodes_after"],
                         num.get("max_abs_err"), num.get("rel_err"), flag])
        console.print(table(f"graph {g['graph']}: passes",
                            ["pass", "status", "matches", "ms", "nodes before", "nodes after",
                             "max abs err", "rel err", "numerics"], rows))
        if g["first_bad_pass"]:
            console.print(f"[red]first pass past the tolerance: {g['first_bad_pass']}[/]")
    if why:
        misses = g["near_misses"]
        matched = {p["name"]: p["matches"] for p in g["passes"]}
        for name in why:
            key = name.replace("-", "_")
            console.print(f"{key}: {matched.get(key, 0)} rewrites, "
                          f"{sum(m['pass_name'] == key for m in misses)} near misses")
        if misses:
            console.print(table(f"graph {g['graph']}: near misses", ["pass", "candidate", "stopped at", "reason"],
                                [[m["pass_name"], m["anchor"], m["node"], m["reason"]] for m in misses]))
