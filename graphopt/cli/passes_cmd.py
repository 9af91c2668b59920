"""``graphopt passes``: every registered pass, the default pipeline first and in order,
with its options (type, default, help)."""

from __future__ import annotations

import typer
from rich.markup import escape

from graphopt.cli.output import console, print_json, table


def passes(json_out: bool = typer.Option(
        False, "--json", help="print a JSON list of {name, summary, default, requires, options: [{name, type, default, help}]}"),
) -> None:
    """List the passes: the default pipeline in the order it runs, then the optional ones,
    each with the options it takes (set them with -o pass_options='{"PASS": {"OPTION": VALUE}}').

    Example: graphopt passes --json
    """
    from graphopt.pass_manager import options_schema
    from graphopt.pipeline import DEFAULT_PIPELINE
    from graphopt.registry import all_passes

    registered = all_passes()
    order = list(DEFAULT_PIPELINE) + sorted(n for n in registered if n not in DEFAULT_PIPELINE)
    rows = [{"name": n, "summary": registered[n].summary, "default": n in DEFAULT_PIPELINE,
             "requires": list(registered[n].requires), "options": options_schema(registered[n])} for n in order]
    if json_out:
        print_json(rows)
        return
    console.print(table("graphopt passes", ["pass", "default", "summary"],
                        [[r["name"], f"#{i + 1}" if r["default"] else "-", r["summary"]] for i, r in enumerate(rows)]))
    options = [[r["name"], o["name"], o["type"], repr(o["default"]), o["help"] or ""] for r in rows for o in r["options"]]
    console.print(table("pass options", ["pass", "option", "type", "default", "help"], [[escape(str(c)) for c in row]
                                                                                        for row in options]))
