"""``graphopt passes``: every registered pass, the default pipeline first and in order."""

from __future__ import annotations

import typer

from graphopt.cli.output import console, print_json, table


def passes(json_out: bool = typer.Option(False, "--json", help="print a JSON list of {name, summary, default}")) -> None:
    """List the passes: the default pipeline in the order it runs, then the optional ones.

    Example: graphopt passes --json
    """
    from graphopt.pipeline import DEFAULT_PIPELINE
    from graphopt.registry import all_passes

    registered = all_passes()
    order = list(DEFAULT_PIPELINE) + sorted(n for n in registered if n not in DEFAULT_PIPELINE)
    rows = [{"name": n, "summary": registered[n].summary, "default": n in DEFAULT_PIPELINE} for n in order]
    if json_out:
        print_json(rows)
        return
    console.print(table("graphopt passes", ["pass", "default", "summary"],
                        [[r["name"], f"#{i + 1}" if r["default"] else "-", r["summary"]] for i, r in enumerate(rows)]))
