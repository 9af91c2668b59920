"""How ``graphopt debug`` prints for people: tables, the bisect verdict, reproducer lines.

Everything here reads the dict ``--json`` prints, so both outputs say the same things.
"""

from __future__ import annotations

from rich.markup import escape

from graphopt.cli.output import console, fmt, table


def print_graph(g: dict, show_table: bool, why: list[str]) -> None:
    if show_table:
        rows = []
        for p in g["passes"]:
            num = p.get("numerics") or {}
            flag = "" if not num else ("ok" if num.get("ok") else "FAIL")
            rows.append([p["name"], p["status"], p["matches"], p["time_ms"], p["nodes_before"], p["nodes_after"],
                         num.get("max_abs_err"), num.get("rel_err"), num.get("rel_err_vs_input"), flag])
        console.print(table(f"graph {g['graph']}: passes (errors: vs the previous pass's output, and vs the input)",
                            ["pass", "status", "matches", "ms", "nodes before", "nodes after",
                             "max abs err", "rel err", "rel err vs input", "numerics"], rows))
        if g["first_bad_pass"]:
            console.print(f"[red]first pass whose own change is past the tolerance: {g['first_bad_pass']}[/]")
        drift = g.get("first_drift_pass")
        if drift and drift != g["first_bad_pass"]:
            console.print(f"[yellow]the output is past the tolerance vs the input from {drift} on: "
                          "the errors of several passes add up[/]")
    for p in g["passes"]:
        if p["status"] == "failed":
            console.print(f"[red]pass {p['name']} failed and was skipped:[/] {escape(p['error'] or '')}")
    if why:
        print_why(g, why)


def print_why(g: dict, why: list[str]) -> None:
    """Per pass: rewrites and near misses; each near miss in full; anchors a pass's screen
    dismissed before matching, grouped by reason (one line per reason, not per node)."""
    misses = [m for m in g["near_misses"] if not m.get("screened")]
    screened = [m for m in g["near_misses"] if m.get("screened")]
    matched = {p["name"]: p["matches"] for p in g["passes"]}
    status = {p["name"]: p.get("status") for p in g["passes"]}
    for name in why:
        key = name.replace("-", "_")
        if key not in matched:  # "0 near misses" would read as "it looked and found nothing"
            console.print(f"{key}: not in the pipeline ({', '.join(matched)}), so it looked at nothing; "
                          f"add it with --pipeline")
            continue
        if status[key] == "disabled":
            console.print(f"{key}: disabled (--disable-pass), so it looked at nothing")
            continue
        console.print(f"{key}: {matched[key]} rewrites, "
                      f"{sum(m['pass_name'] == key for m in misses)} near misses, "
                      f"{sum(m['pass_name'] == key for m in screened)} anchors screened out")
    if misses:
        console.print(table(f"graph {g['graph']}: near misses", ["pass", "candidate", "stopped at", "reason"],
                            [[m["pass_name"], m["anchor"], m["node"], m["reason"]] for m in misses]))
    if screened:
        groups: dict[tuple[str, str], list[str]] = {}
        for m in screened:
            groups.setdefault((m["pass_name"], m["reason"]), []).append(m["anchor"])
        rows = [[p, reason, len(nodes), ", ".join(nodes[:3]) + (", ..." if len(nodes) > 3 else "")]
                for (p, reason), nodes in groups.items()]
        console.print(table(f"graph {g['graph']}: screened out before matching",
                            ["pass", "reason", "anchors", "e.g."], rows))


def print_extras(out: dict) -> None:
    """The bisect verdict, the reproducer and the report, after the per-graph tables."""
    if "bisect" in out:
        print_bisect(out)
    if "reproducer" in out:
        written = out["reproducer"]
        if written:
            console.print(f"wrote a reproducer of the failure of [bold]{written['pass']}[/] to {escape(written['dir'])}")
            console.print(f"rerun it: {escape(written['command'])}", soft_wrap=True)
        elif out.get("reproducer_error"):
            console.print(f"[red]could not write the reproducer:[/] {escape(out['reproducer_error'])}")
        else:
            console.print("no pass failed; no reproducer written")
    if "report" in out:
        r = out["report"]
        pictures = "Graphviz dot" if r["renderer"] == "dot" else "built-in layout"
        console.print(f"wrote {escape(r['path'])} ({r['bytes'] / 1024:.0f} KiB, pictures: {pictures})")


def print_bisect(out: dict) -> None:
    b = out["bisect"]
    if b is None:
        console.print(f"[green]bisect: {escape(out.get('bisect_summary', 'output within tolerance'))}[/]")
        return
    console.print(f"bisect: graph {b['graph']}: relative error {fmt(b['full_rel_err'])} > tolerance "
                  f"{b['tolerance']:g} after all {b['total_rewrites']} rewrites; {b['runs']} pipeline runs")
    console.print(f"first bad pass: [bold red]{b['pass']}[/]")
    if b["rewrite_index"] is not None:
        console.print(f"first bad rewrite: [bold]#{b['rewrite_index']}[/] ({b['pass']} at node "
                      f"[bold]{b['node']}[/], {b['target']}); relative error {fmt(b['rel_err_before'])} -> "
                      f"{fmt(b['rel_err'])}")
    if b.get("note"):
        console.print(f"note: {escape(b['note'])}")
    console.print(f"reproduce: {escape(b['command'])}", soft_wrap=True)
    if b.get("good_command"):
        console.print(f"(with --bisect-limit {b['rewrite_index'] - 1} it stays within tolerance)")
    if b.get("diff"):
        console.print(escape(b["diff"]), highlight=False, soft_wrap=True)


def print_replay(outcome) -> None:
    if outcome.reproduced:
        console.print(f"[red]reproduced:[/] pass {outcome.pass_name} failed: {escape(outcome.error or '')}")
    else:
        console.print(f"[green]not reproduced:[/] pass {outcome.pass_name} now {outcome.status} "
                      f"(it failed with: {escape(outcome.expected_error)})")


def print_routing(out: dict, width: int = 40) -> None:
    """``--routing``: per MoE layer, a bar per expert (its share of (token, slot) pairs) and
    the top-k jitter between consecutive decode steps."""
    from graphopt.report import routing_table

    console.print(f"routing of {escape(out['model'])}: a {out['prompt_tokens']}-token prompt, then "
                  f"{out['decode_steps']} decode steps (target {out['target']})")
    if not out["layers"]:
        console.print(f"[yellow]nothing recorded:[/] {escape(out['why_empty'])}")
        return
    for layer in out["layers"]:
        counts = layer["tokens_per_expert"]
        top = max(counts) or 1
        console.print(f"\n[bold]{escape(layer['layer'])}[/]: {layer['tokens']} tokens x top-{layer['k']}, "
                      f"max/mean {fmt(layer['imbalance'])}")
        for expert, n in enumerate(counts):
            console.print(f"  expert {expert:>3} {'#' * round(width * n / top):<{width}} {n}", highlight=False)
        rate = layer["topk_change_rate"]
        console.print("  top-k jitter: " + (f"{rate:.3f} ({layer['topk_changes']} of {layer['rows_compared']} rows "
                                             "changed their expert set between consecutive steps)"
                                             if rate is not None else "no consecutive steps of the same size"))
    console.print("")
    console.print(escape(routing_table(out["layers"])), highlight=False)
