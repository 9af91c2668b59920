"""Every registered pass is complete: name, summary, options, docstring, a test file."""

import dataclasses
import importlib
from pathlib import Path

import pytest

from graphopt.pipeline import DEFAULT_PIPELINE, build_pipeline
from graphopt.registry import all_passes

TESTS = Path(__file__).resolve().parents[1] / "passes"
PASSES = sorted(all_passes().items())


@pytest.mark.parametrize("name, p", PASSES, ids=[n for n, _ in PASSES])
def test_pass_is_complete(name, p):
    assert p.name == name
    assert p.summary and "\n" not in p.summary and len(p.summary) <= 100
    assert dataclasses.is_dataclass(p.Options)
    assert isinstance(p.requires, tuple)
    module = importlib.import_module(f"graphopt.passes.{name}")
    assert module.__doc__ and "->" in module.__doc__, "module docstring must state the rewrite as an arrow"
    assert (TESTS / f"test_{name}.py").exists(), f"tests/passes/test_{name}.py is missing"


def test_default_pipeline_builds_in_order():
    passes = build_pipeline()
    assert [p.name for p in passes] == list(DEFAULT_PIPELINE)
    assert len(set(DEFAULT_PIPELINE)) == len(DEFAULT_PIPELINE)
