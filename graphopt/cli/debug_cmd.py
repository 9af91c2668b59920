"""``graphopt debug MODEL``: what each pass did, why a fusion did not fire, where numerics broke.

The switches are MLIR's pass instrumentation on FX graphs. The pipeline runs on the
exact ATen graphs the torch.compile backend would see (captured through dynamo).
Printing lives in debug_print; bisecting, reproducers and the HTML page in graphopt.debug.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import typer

from graphopt.cli import debug_print
from graphopt.cli.common import MODEL_HELP, load, parse_options
from graphopt.cli.output import print_json, step
from graphopt.errors import OptionsError
from graphopt.sources.model_kind import decodes


def debug(
    model: str = typer.Argument(None, help=MODEL_HELP + " (not needed with --replay)"),
    pipeline: str = typer.Option(None, "--pipeline", help='comma-separated passes to run instead of the default, e.g. "canonicalize,fuse_rms_norm"'),
    disable_pass: list[str] = typer.Option([], "--disable-pass", help="leave this pass out (repeatable)"),
    print_ir_before: list[str] = typer.Option([], "--print-ir-before", help="print the graph before PASS (repeatable)"),
    print_ir_after: list[str] = typer.Option([], "--print-ir-after", help="print the graph after PASS (repeatable)"),
    print_ir_after_all: bool = typer.Option(False, "--print-ir-after-all", help="print the graph after every pass"),
    print_ir_after_change: bool = typer.Option(False, "--print-ir-after-change", help="print the graph after each pass that changed it"),
    print_ir_after_failure: bool = typer.Option(False, "--print-ir-after-failure", help="print the graph a pass failed on"),
    diff: bool = typer.Option(False, "--diff", help="print each change as a unified diff instead of the whole graph"),
    timing: bool = typer.Option(False, "--timing", help="table of passes: wall time, nodes before/after, matches"),
    check_numerics: bool = typer.Option(False, "--check-numerics", help="run the graph after every pass that changed it; compare with the previous pass's output (names the culprit) and with the input graph"),
    tolerance: float = typer.Option(1e-4, "--tolerance", help="relative error that flags a pass in --check-numerics and --bisect"),
    why: list[str] = typer.Option([], "--why", help="near misses of PASS: where matching stopped and why (repeatable)"),
    bisect_limit: int = typer.Option(-1, "--bisect-limit", help="allow only N rewrites in total (-1: all)"),
    bisect: bool = typer.Option(False, "--bisect", help="find the first pass, then the first rewrite, that takes the output past --tolerance"),
    report: Path = typer.Option(None, "--report", help="write one self-contained HTML page (tables, graph pictures, numerics) to this file"),
    reproducer: Path = typer.Option(None, "--reproducer", help="when a pass fails, write its input graph and the pipeline to this directory"),
    replay: Path = typer.Option(None, "--replay", help="rerun the failure stored in a --reproducer directory (exit 1 while it fails)"),
    seq_len: int = typer.Option(16, "--seq-len", help="sequence length of the random inputs"),
    seed: int = typer.Option(0, help="seed for weights and inputs"),
    routing: bool = typer.Option(False, "--routing", help="MoE models: compile with record_routing, run the prompt and --decode-steps steps; print tokens per expert and top-k jitter per layer"),
    decode_steps: int = typer.Option(8, "--decode-steps", help="decode steps after the prompt for --routing"),
    lower_target: str = typer.Option(None, "--target", help="also lower each optimized graph with this target's exporter (onnxruntime) and list its own passes (onnx:*) after graphopt's, with their near misses"),
    json_out: bool = typer.Option(False, "--json", help="print everything as JSON"),
) -> None:
    """Run graphopt's pipeline on MODEL with pass instrumentation.

    Examples:
      graphopt debug llama-tiny --timing --check-numerics
      graphopt debug llama-tiny --why fuse_rms_norm
      graphopt debug llama-tiny --print-ir-after-change --diff
      graphopt debug llama-tiny --pipeline canonicalize,fuse_rms_norm,quantize_int4 --bisect --tolerance 1e-4
      graphopt debug llama-tiny --report out.html
      graphopt debug llama-tiny --timing --target onnxruntime   # the ONNX-level passes too
      graphopt debug llama-tiny --reproducer repro/ ; graphopt debug --replay repro/
    """
    # The pipeline's machinery (dynamo, the instruments) loads with the command that runs it:
    # importing it for every command cost `graphopt generate` 1.4 s of a warm start.
    from graphopt.compiler import run_pipeline
    from graphopt.debug.reproducer import WriteReproducer
    from graphopt.frontend.trace import capture_aten_graphs
    from graphopt.instrument import KeepChanges, NumericCheck, PrintIR

    from graphopt.registry import get_pass

    if replay is not None:
        _replay(replay, json_out)
        return
    if model is None:
        raise OptionsError("graphopt debug needs a MODEL (e.g. llama-tiny), or --replay DIR to rerun a reproducer")
    if bisect and bisect_limit >= 0:
        raise OptionsError("--bisect searches the rewrite limit itself; drop --bisect-limit (or drop --bisect to set it by hand)")
    # Unknown names fail now, with the list of known passes; fuse-rms-norm means fuse_rms_norm.
    why = [name if name.startswith("onnx:") else get_pass(name).name for name in why]  # onnx:*: --target's passes
    print_ir_before, print_ir_after, disable_pass = (
        [get_pass(name).name for name in names] for names in (print_ir_before, print_ir_after, disable_pass))
    lowering = _exporter(lower_target) if lower_target else None
    config = parse_options([], pipeline=pipeline, disable_passes=list(disable_pass) or None,
                           bisect_limit=bisect_limit, tolerance=tolerance, target="eager")
    if routing:
        _routing(model, config, seq_len, seed, decode_steps, json_out)
        return
    with step(f"loading {model}", json_out):
        loaded = load(model, seed, 1, seq_len)
    with step("capturing ATen graphs", json_out):
        graphs = capture_aten_graphs(loaded.module, loaded.example_inputs, config)
    pipeline_text = _pipeline_names(config)

    def command(*extra: str) -> str:
        return _command(model, pipeline_text, disable_pass, seq_len, seed, *extra)

    printer = PrintIR(print_ir_before, print_ir_after, print_ir_after_all, print_ir_after_change,
                      print_ir_after_failure, diff, stream=None if json_out else sys.stdout)
    results, kept, writer = [], [], None
    for index, graph in enumerate(graphs):
        instruments = [printer]
        checker = None
        if (check_numerics or report is not None) and graph.example_inputs is not None:
            checker = NumericCheck(graph.example_inputs, tolerance)
            instruments.append(checker)
        keeper = KeepChanges()
        if report is not None:
            instruments.append(keeper)
        if reproducer is not None and (writer is None or (writer.written is None and writer.error is None)):
            writer = WriteReproducer(str(reproducer), pipeline_text, graph.example_inputs,
                                     origin={"model": model, "graph": index,
                                             "command": command("--print-ir-after-failure")})
            instruments.append(writer)
        result, _ = run_pipeline(graph.gm, config, graph.example_inputs, instruments)
        results.append(_graph_result(index, result, checker, why))
        if lowering is not None:
            _add_lowering(results[-1], lowering, result.gm, graph.example_inputs, why)
        kept.append(keeper.changes)
    out = {"model": loaded.name, "pipeline": pipeline_text, "tolerance": tolerance, "graphs": results, "ir": printer.chunks}
    if why:  # a pass outside the pipeline looked at nothing: say so rather than "0 near misses"
        ran = pipeline_text.split(",") + [p["name"] for g in results for p in g["passes"] if p["name"].startswith("onnx:")]
        out["why_not_in_pipeline"] = [name for name in why if name not in ran]
    if bisect:
        _bisect(out, graphs, config, tolerance, command)
    if reproducer is not None:
        _reproducer_result(out, writer)
    if report is not None:
        from graphopt.debug.html_report import write_report

        with step(f"writing {report}", json_out):
            out["report"] = write_report(report, out, kept)
    if json_out:
        print_json(out)
        return
    for g in results:
        debug_print.print_graph(g, timing or check_numerics, why)
    debug_print.print_extras(out)


def _routing(model: str, config, seq_len: int, seed: int, steps: int, json_out: bool) -> None:
    """Greedy decode with ``record_routing`` on (eager target): per MoE layer, tokens per expert
    over prompt and steps, and how often a row's top-k expert set changes from step to step."""
    import graphopt
    from graphopt.sources import load_model
    from graphopt.generation import generate
    from graphopt.routing import merged_summary

    if steps < 2:
        raise OptionsError(f"--decode-steps must be at least 2 to compare consecutive steps, got {steps}")
    with step(f"loading {model}", json_out):
        loaded = load_model(model, seed, batch=1, seq_len=seq_len, single_output=False)
    if not decodes(loaded.module):
        raise OptionsError(f"--routing decodes a causal LM with MoE layers (e.g. a Mixtral config.json); "
                           f"{model} is a {loaded.family} model")
    graphopt.reset()
    with step(f"decoding {steps} steps with record_routing", json_out):
        # steps + 1 tokens: the prompt's pass gives the first, each decode step one more
        result = generate(loaded.module, loaded.example_inputs[0], steps + 1,
                          options=config.replace(record_routing=True).to_dict())
    reports = result.reports
    out = {"model": loaded.name, "prompt_tokens": int(loaded.example_inputs[0].numel()), "decode_steps": steps,
           "target": result.target, "layers": merged_summary(reports), "why_empty": None}
    if not out["layers"]:
        out["why_empty"] = _no_routing_reason(result, reports)
    if json_out:
        print_json(out)
        return
    debug_print.print_routing(out)


def _no_routing_reason(result, reports) -> str:
    """One line: why a --routing run recorded nothing."""
    from graphopt.passes.fuse_moe import GROUPED_MM_HINT

    if result.fallback:
        reason = result.fallback.splitlines()[0]
        if "data-dependent" in reason:  # e.g. transformers' eager experts loop: its trip count depends on the routing
            return (f"graphopt did not compile the model ({reason}); an expert loop whose trip count depends on "
                    f"the routing cannot be captured: {GROUPED_MM_HINT}")
        return f"graphopt did not compile the model ({reason}); nothing was recorded"
    misses = [m for r in reports for m in r.near_misses if m.pass_name == "fuse_moe"]
    if misses:
        return f"no graphopt.moe in the compiled graphs; fuse_moe: {misses[0].reason}"
    return ("no graphopt.moe in the compiled graphs: the model has no MoE block fuse_moe recognises "
            "(see graphopt debug MODEL --why fuse_moe)")


def _pipeline_names(config) -> str:
    from graphopt.pipeline import build_pipeline, pipeline_string

    return pipeline_string(build_pipeline(config.pipeline or None, int4=config.int4))


def _command(model: str, pipeline: str, disabled: list[str], seq_len: int, seed: int, *extra: str) -> str:
    """The ``graphopt debug`` command line that reruns this model with ``extra`` flags."""
    parts = ["graphopt", "debug", model, "--pipeline", pipeline]
    for name in disabled:
        parts += ["--disable-pass", name]
    if seq_len != 16:
        parts += ["--seq-len", str(seq_len)]
    if seed != 0:
        parts += ["--seed", str(seed)]
    return shlex.join([*parts, *extra])


def _exporter(name: str):
    """The exporter target ``name`` lends (the ONNX Runtime target's); one line otherwise."""
    from graphopt.targets import get_target

    target = get_target(name)  # an unknown or unavailable target: its own one line
    lowering = getattr(target, "exporter", None)
    if lowering is None:
        raise OptionsError(f"--target {name}: that target lends no exporter to show passes of; use --target onnxruntime")
    return lowering


def _add_lowering(g: dict, lowering, gm, example_inputs, why: list[str]) -> None:
    """The lowering's own passes after graphopt's (their records and near misses), or why not."""
    if example_inputs is None:  # symbolic inputs (a dynamic graph): no shapes to lower at
        g["lowering"] = "not lowered: the graph has symbolic inputs"
        return
    model = lowering.lower_graph(gm, example_inputs)
    wanted = {w.replace("-", "_") for w in why}
    g["passes"] += [r.to_dict() for r in lowering.pass_records(model)]
    g["near_misses"] += [m.to_dict() for m in lowering.pass_near_misses(model) if not wanted or m.pass_name in wanted]
    g["lowering"] = f"lowered with {lowering.runtime}'s exporter"


def _graph_result(index, result, checker, why) -> dict:
    wanted = {w.replace("-", "_") for w in why}
    return {
        "graph": index,
        "passes": [r.to_dict() for r in result.records],
        "near_misses": [m.to_dict() for m in result.near_misses if not wanted or m.pass_name in wanted],
        "first_bad_pass": checker.first_bad if checker else None,  # its own change is past the tolerance
        "first_drift_pass": checker.first_drift if checker else None,  # from here on, past it vs the input
        "rewrites": [r.to_dict() for r in result.rewrites],
        "fallbacks": list(result.fallbacks),
    }


def _bisect(out: dict, graphs, config, tolerance: float, command) -> None:
    """Bisect each graph with inputs; ``out["bisect"]`` is the first graph's culprit or None."""
    from graphopt.debug.bisect import bisect_rewrites

    out["bisect"], worst, skipped = None, 0.0, 0
    for graph, g in zip(graphs, out["graphs"]):
        if graph.example_inputs is None:
            skipped += 1  # symbolic inputs: nothing concrete to run
            continue
        outcome = bisect_rewrites(graph.gm, graph.example_inputs, config, tolerance)
        g["bisect"] = outcome.to_dict()
        worst = max(worst, outcome.full_rel_err)
        if outcome.found is None or out["bisect"] is not None:
            continue
        k = outcome.found.rewrite_index
        limit = k if k is not None else 0
        out["bisect"] = {**outcome.to_dict(), "graph": g["graph"],
                         "command": command("--bisect-limit", str(limit), "--check-numerics", "--tolerance", f"{tolerance:g}"),
                         "good_command": (command("--bisect-limit", str(k - 1), "--check-numerics", "--tolerance", f"{tolerance:g}")
                                          if k is not None else None)}
    if out["bisect"] is None:
        out["bisect_summary"] = (f"output within tolerance: relative error {worst:.3g} <= {tolerance:g} "
                                 f"on {len(graphs) - skipped} graph(s); nothing to bisect"
                                 + (f" ({skipped} graph(s) without concrete inputs skipped)" if skipped else ""))


def _reproducer_result(out: dict, writer) -> None:
    written = writer.written if writer else None
    out["reproducer"] = ({**written, "command": f"graphopt debug --replay {written['dir']}"} if written else None)
    if writer is not None and writer.error:
        out["reproducer_error"] = writer.error


def _replay(directory: Path, json_out: bool) -> None:
    from graphopt.debug.reproducer import replay

    outcome = replay(directory, stream=None if json_out else sys.stdout)
    if json_out:
        print_json({"replay": outcome.to_dict()})
    else:
        debug_print.print_replay(outcome)
    if outcome.reproduced:
        raise typer.Exit(code=1)
