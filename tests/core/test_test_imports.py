"""Tests import graphopt's own modules directly: an importorskip of a graphopt module
would turn a broken import into a skip that CI reports as green."""

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
HIDDEN = re.compile(r"importorskip\(\s*[fr]?[\"']graphopt")


def test_no_test_skips_on_an_import_of_graphopt():
    offenders = [f"{path.relative_to(TESTS)}:{n}" for path in sorted(TESTS.rglob("*.py"))
                 for n, line in enumerate(path.read_text().splitlines(), 1) if HIDDEN.search(line)]
    assert not offenders, "import graphopt modules directly, not with importorskip: " + ", ".join(offenders)
