"""Every registered pass is complete (name, summary, options with help text, docstring, a
test file) and keeps no state between runs; passes are registered through the public API;
the pass manager, the registry and the pipeline import each other in one direction only."""

import ast
import copy
import dataclasses
import importlib
from pathlib import Path

import pytest
import torch

import graphopt
from graphopt import models
from graphopt.errors import OptionsError
from graphopt.pass_manager import NoOptions, PassContext, PassResult, options_schema
from graphopt.pipeline import DEFAULT_PIPELINE, build_pipeline
from graphopt.registry import all_passes, get_pass
from tests.helpers import aten_graph

TESTS = Path(__file__).resolve().parents[1] / "passes"
CORE = Path(graphopt.__file__).resolve().parent
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


@pytest.mark.parametrize("name, p", PASSES, ids=[n for n, _ in PASSES])
def test_every_option_has_one_line_of_help(name, p):
    """`graphopt passes` shows these: field(default=..., metadata={"help": "one line"})."""
    missing = [o["name"] for o in options_schema(p) if not o["help"]]
    assert not missing, f"{name}.Options fields without metadata['help']: {', '.join(missing)}"
    for o in options_schema(p):
        assert "\n" not in o["help"] and len(o["help"]) <= 120, f"{name}.{o['name']}: help must be one short line"


def test_options_schema_reads_types_defaults_and_help():
    schema = {o["name"]: o for o in options_schema(get_pass("quantize_int4"))}
    assert schema["group_size"]["type"] == "int" and schema["group_size"]["default"] == 32
    assert schema["skip"]["default"] == [] and "fnmatch" in schema["skip"]["help"]
    assert options_schema(get_pass("canonicalize")) == []  # NoOptions: nothing to show


def test_default_pipeline_builds_in_order():
    passes = build_pipeline()
    assert [p.name for p in passes] == list(DEFAULT_PIPELINE)
    assert len(set(DEFAULT_PIPELINE)) == len(DEFAULT_PIPELINE)


def test_passes_keep_no_state_between_runs():
    """Pass objects are shared by every compile: a run must leave nothing on them."""
    model = models.build("llama-tiny")
    gm = aten_graph(model, *models.example_inputs("llama-tiny", batch=1, seq_len=8))
    before = {name: copy.deepcopy(vars(p)) for name, p in PASSES}
    ctx = PassContext()
    for name, p in PASSES:
        gm = p.run(gm, ctx).gm
    changed = [name for name, p in PASSES if vars(p).keys() != before[name].keys()
               or any(vars(p)[k] is not v and vars(p)[k] != v for k, v in before[name].items())]
    assert not changed, f"passes that keep state on their shared object: {', '.join(changed)}"


@dataclasses.dataclass
class _Noop:
    name: str = "noop_for_tests"
    summary: str = "does nothing (tests)"
    Options: type = NoOptions
    requires: tuple = ()

    def run(self, gm, ctx):
        return PassResult(gm, modified=False, stats={"matches": 0})


def test_register_pass_makes_it_usable_and_unregister_removes_it():
    p = graphopt.register_pass(_Noop())
    try:
        assert get_pass("noop-for-tests") is p
        assert [q.name for q in build_pipeline(["canonicalize", "noop_for_tests"])] == ["canonicalize", "noop_for_tests"]
        with pytest.raises(OptionsError, match="'noop_for_tests' is already registered; pass replace=True"):
            graphopt.register_pass(_Noop())
        other = graphopt.register_pass(_Noop(summary="replaced"), replace=True)
        assert get_pass("noop_for_tests") is other
    finally:
        assert graphopt.unregister_pass("noop_for_tests").summary == "replaced"
    with pytest.raises(OptionsError, match="unknown pass 'noop_for_tests'"):
        get_pass("noop_for_tests")


@pytest.mark.parametrize("broken, reason", [
    (_Noop(name="has space"), "name must be an identifier"),
    (_Noop(summary="two\nlines"), "one-line summary"),
    (_Noop(Options=dict), "Options must be a dataclass"),
    (_Noop(requires=["canonicalize"]), "requires must be a tuple"),
])
def test_register_pass_refuses_an_incomplete_pass(broken, reason):
    with pytest.raises(OptionsError, match=reason):
        graphopt.register_pass(broken)
    assert "has space" not in all_passes() and "noop_for_tests" not in all_passes()


def test_scoped_passes_restores_the_registry_and_the_registry_is_read_only():
    original = dict(all_passes())
    with graphopt.scoped_passes(_Noop(name="canonicalize"), remove=("fuse_rope",)):
        assert get_pass("canonicalize").summary == "does nothing (tests)" and "fuse_rope" not in all_passes()
        graphopt.register_pass(_Noop())
    assert dict(all_passes()) == original
    with pytest.raises(TypeError):
        all_passes()["x"] = _Noop()  # type: ignore[index]


def _graphopt_imports(path: Path) -> set[str]:
    """Modules under graphopt that ``path`` imports, at any depth (lazy imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.startswith("graphopt")}


def test_pass_manager_registry_and_pipeline_import_in_one_direction():
    assert not _graphopt_imports(CORE / "pass_manager.py") & {"graphopt.registry", "graphopt.pipeline"}
    assert "graphopt.pipeline" not in _graphopt_imports(CORE / "registry.py")
    assert {"graphopt.registry", "graphopt.pass_manager"} <= _graphopt_imports(CORE / "pipeline.py")
