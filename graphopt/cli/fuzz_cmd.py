"""``graphopt fuzz``: differential testing of graphopt against eager on random models."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from graphopt.cli.output import console, print_json, status_console, table


def fuzz(
    graphs: int = typer.Option(100, "--graphs", "-n", min=1, help="how many random models to generate and check"),
    seed: int = typer.Option(0, "--seed", help="seed of the run; graph i of seed S is the same model every time"),
    target: list[str] = typer.Option([], "--target", "-t",
                                     help="eager | onnxruntime | triton | tensorrt (repeatable); "
                                          "default: every one of eager, onnxruntime, triton that can run here"),
    out: Path = typer.Option(Path("fuzz-failures"), "--out", help="folder for the reproducers of failures"),
    max_steps: int = typer.Option(8, "--max-steps", min=1, help="most ops and planted patterns in one model"),
    only: list[str] = typer.Option([], "--only", help="generate only these step kinds (repeatable), e.g. "
                                                       "plant_rms_norm; see graphopt.fuzz.generate.kinds()"),
    shrink_budget: int = typer.Option(40, "--shrink-budget", min=0, help="most compiles spent shrinking one failure"),
    json_out: bool = typer.Option(False, "--json", help="print JSON: graphs, mismatches, crashes, fallbacks, hits, ..."),
) -> None:
    """Generate random models with fusion patterns planted in them, compile each with graphopt
    on every available target, and compare with eager PyTorch. A mismatch or crash is shrunk
    and written to --out as a reproducer; the exit status is 1 when there was any. Without a GPU
    the triton target runs only in triton's interpreter: start with TRITON_INTERPRET=1.

    Example: graphopt fuzz --graphs 500 --seed 0 --target eager --json
    """
    from graphopt.fuzz.generate import Settings
    from graphopt.fuzz.runner import resolve_targets, run_fuzz

    usable, skipped = resolve_targets(target or None)  # bad names fail here, before any work
    show = not json_out and sys.stderr.isatty()
    progress = Progress(TextColumn("fuzzing {task.fields[targets]}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[status]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                        console=status_console, disable=not show, transient=True)
    with progress:
        task = progress.add_task("fuzz", total=graphs, targets=", ".join(usable), status="")

        def advance(index, summary) -> None:
            status = f"{summary.mismatches} mismatches, {summary.crashes} crashes"
            progress.update(task, completed=index + 1, status=status)

        summary = run_fuzz(graphs, seed, usable or target or None, out, Settings(max_steps=max_steps, only=tuple(only)),
                           shrink_budget=shrink_budget, on_graph=advance)
    summary.skipped_targets = {**skipped, **summary.skipped_targets}
    result = summary.to_dict()
    if json_out:
        print_json(result)
    else:
        _print_human(result)
    if summary.mismatches or summary.crashes:
        raise typer.Exit(1)


def _print_human(result: dict) -> None:
    console.print(table(
        f"graphopt fuzz: {result['graphs']} graphs, seed {result['seed']}, {result['seconds']} s",
        ["target", "graphs", "mismatches", "crashes", "routing ties", "graphs with fallbacks", "worst ok rel err"],
        [[name, s["graphs"], s["mismatches"], s["crashes"], s["routing_ties"], s["fell_back"], s["worst_rel_err"]]
         for name, s in result["targets"].items()]))
    for name, reason in result["skipped_targets"].items():
        console.print(f"[yellow]skipped[/] {name}: {reason}")
    console.print(table("pattern hits per pass", ["pass", "planted", "hits", "near misses"],
                        [[p, result["planted"].get(p, 0), n, result["near_misses"].get(p, 0)]
                         for p, n in result["hits"].items()]))
    if result["no_hits"]:
        console.print(f"[yellow]fusion passes that never fired[/]: {', '.join(result['no_hits'])}")
    for f in result["fallbacks"][:15]:
        console.print(f"[yellow]fallback[/] {f['target']} {f['where']} ({f['graphs']} graphs, {'/'.join(f['dtypes'])}): {f['reason']}")
    if len(result["fallbacks"]) > 15:
        console.print(f"... {len(result['fallbacks']) - 15} more kinds of fallback (see --json)")
    if result["invalid"]:
        console.print(f"[yellow]{result['invalid']} generated models could not run eagerly[/] "
                      f"(a generator bug): {'; '.join(result['invalid_examples'])}")
    for t in result["routing_ties"]:  # not failures: the token may go either way
        console.print(f"[yellow]routing tie[/] {t['graph']} on {t['target']}: {t['detail']}")
    for f in result["failures"]:
        where = f" -> {f['reproducer']}" if f["reproducer"] else ""
        console.print(f"[red]{f['status']}[/] graph {f['graph']} on {f['target']}: {f['detail']} "
                      f"(shrunk {f['steps_before']} -> {f['steps_after']} steps){where}")
