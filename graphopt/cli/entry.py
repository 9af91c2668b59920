"""The ``graphopt`` command's entry point: restart on huge pages (graphopt/huge_pages.py)
before the command line's modules load, then run it. Kept apart from ``main.py`` so the
restart costs an interpreter start and not typer's and the commands' imports as well."""

from __future__ import annotations


def main() -> None:
    from graphopt.huge_pages import restart_with_huge_pages

    restart_with_huge_pages()
    from graphopt.cli.main import main as run

    run()


if __name__ == "__main__":
    main()
