"""The ``graphopt`` command line."""

from __future__ import annotations

import inspect
import logging
import sys

import typer

from graphopt.cli import debug_cmd, passes_cmd, run_cmd
from graphopt.cli import export_cmd
from graphopt.cli import fuzz_cmd
from graphopt.cli import kernels_cmd
from graphopt.cli import generate_cmd
from graphopt.cli.output import console, error_line, print_json, table
from graphopt.errors import GraphoptError

app = typer.Typer(
    help="graphopt: compile PyTorch models for inference with fusion, KV-cache and INT4 passes.\n\n"
         "Start with: graphopt run llama-tiny",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _help(fn) -> str:
    """The docstring with each prose paragraph on one line: this typer prints a docstring's
    line breaks as they are, so a paragraph wrapped at 100 columns came out ragged at 80.
    Example blocks keep their lines (one command each)."""
    paragraphs = inspect.cleandoc(fn.__doc__ or "").split("\n\n")
    return "\n\n".join(p if p.startswith("Example") else " ".join(line.strip() for line in p.splitlines())
                       for p in paragraphs)


for _name, _fn in (("passes", passes_cmd.passes), ("run", run_cmd.run), ("debug", debug_cmd.debug),
                   ("export", export_cmd.export), ("fuzz", fuzz_cmd.fuzz), ("kernels", kernels_cmd.kernels),
                   ("generate", generate_cmd.generate)):
    app.command(_name, help=_help(_fn))(_fn)


@app.command("models")
def models_cmd(json_out: bool = typer.Option(False, "--json", help="print a JSON list")) -> None:
    """List the built-in models (seeded random weights).

    Example: graphopt models --json
    """
    from graphopt import models

    rows = [{"name": m.name, "family": m.family, "parameters": m.params, "description": m.description}
            for m in models.list_models()]
    if json_out:
        print_json(rows)
        return
    console.print(table("built-in models", ["name", "family", "parameters", "description"],
                        [[r["name"], r["family"], f"{r['parameters'] / 1e6:.1f}M", r["description"]] for r in rows]))


@app.command("options")
def options_cmd(json_out: bool = typer.Option(False, "--json", help="print a JSON list")) -> None:
    """List the backend options torch.compile(..., options={...}) and --option take.

    Example: graphopt run llama-tiny -o check_numerics=true -o disable_passes=fuse_rms_norm
    """
    from graphopt.config import describe_options

    rows = describe_options()
    if json_out:
        print_json(rows)
        return
    console.print(table("graphopt options", ["option", "type", "default", "choices", "help"],
                        [[r["name"], r["type"], repr(r["default"]), " | ".join(r["choices"]), r["help"]] for r in rows]))


def _graphopt_error(error: BaseException | None) -> GraphoptError | None:
    """The GraphoptError behind ``error``: torch.compile re-raises what a backend raised as its
    own BackendCompilerFailed (the original in ``inner_exception``), which would print a traceback."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, GraphoptError):
            return error
        seen.add(id(error))
        error = getattr(error, "inner_exception", None) or error.__cause__
    return None


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        app()
    except KeyboardInterrupt:
        error_line("interrupted")
        sys.exit(130)
    except Exception as error:
        cause = _graphopt_error(error)
        if cause is None:
            raise
        error_line(str(cause))
        sys.exit(2)


if __name__ == "__main__":  # python -m graphopt.cli.main: the graphopt command's start (cli/entry.py)
    from graphopt.huge_pages import restart_with_huge_pages

    restart_with_huge_pages()
    main()
