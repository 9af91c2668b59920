"""The layering contract (docs/architecture.md): the core imports no pass module, no backend,
not the CLI and not ``graphopt.debug``, and no module imports itself back through others.

Every ``.py`` under the package roots is parsed with ``ast`` and every ``import`` statement
counts, at module level or inside a function, since a function-local import is the same
dependency paid later. The core reaches passes and targets by name through importlib (the
registry's ``PASS_PACKAGE``, graphopt.targets' ``TABLE``), which is the sanctioned way and not an import.

"Core" is every module under ``graphopt/`` except the applications built on it:
``graphopt.cli``, ``graphopt.debug``, ``graphopt.fuzz`` and ``graphopt.distributed``.
"""

from __future__ import annotations

import ast
import os
import tomllib
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2]
APPLICATIONS = ("graphopt.cli", "graphopt.debug", "graphopt.fuzz", "graphopt.distributed")
NOT_CORE = ("graphopt.passes", "graphopt.backends", "graphopt.models") + APPLICATIONS
FORBIDDEN_TO_CORE = ("graphopt.passes", "graphopt.backends", "graphopt.cli", "graphopt.debug")

# Known violations in files their owners are changing now; each names its fix. An entry that
# no longer occurs fails the test, so the list only shrinks.
ALLOWED_IMPORTS: set[tuple[str, str]] = set()
ALLOWED_CYCLES: set[frozenset[str]] = set()


def package_roots(root: Path = ROOT) -> dict[str, Path]:
    """Package name -> its directory, from pyproject's package-dir (passes/ is graphopt.passes)."""
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: root / folder for name, folder in tool["package-dir"].items()}


def modules(roots: dict[str, Path]) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package's __init__)."""
    found: dict[str, tuple[Path, bool]] = {}
    # Longest package first: passes/ is graphopt.passes even if graphopt/ held a passes/ too.
    for package, folder in sorted(roots.items(), key=lambda kv: -len(kv[0])):
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            name = ".".join([package] + (parts[:-1] if is_package else parts))
            found.setdefault(name, (path, is_package))
    return found


def _imported(name: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str]) -> list[str]:
    """The modules one import statement names (``from pkg import mod`` names pkg.mod)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the importing module's package, up level - 1
        package = name if is_package else name.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def import_graph(roots: dict[str, Path]) -> nx.DiGraph:
    """Module -> module edges for every import between modules under ``roots``; each edge
    keeps the file and line of its first import."""
    base = Path(os.path.commonpath(list(roots.values())))
    found = modules(roots)
    known = set(found)
    graph = nx.DiGraph()
    graph.add_nodes_from(known)
    for name, (path, is_package) in found.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _imported(name, is_package, node, known):
                while target and target not in known:  # graphopt.ops.quant.X -> graphopt.ops.quant
                    target = target.rpartition(".")[0]
                if target and target != name and not graph.has_edge(name, target):
                    graph.add_edge(name, target, where=f"{path.relative_to(base)}:{node.lineno}")
    return graph


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def is_core(name: str) -> bool:
    return _under(name, ("graphopt",)) and not _under(name, NOT_CORE)


def layer_violations(graph: nx.DiGraph) -> dict[tuple[str, str], str]:
    """(core module, module it must not import) -> where."""
    return {(a, b): where for a, b, where in graph.edges(data="where")
            if is_core(a) and _under(b, FORBIDDEN_TO_CORE)}


def import_cycles(graph: nx.DiGraph) -> dict[frozenset[str], list[str]]:
    """Each set of modules that import each other (a strongly connected component), with its edges."""
    return {frozenset(c): sorted(f"{a} -> {b} ({graph.edges[a, b]['where']})" for a, b in graph.subgraph(c).edges)
            for c in nx.strongly_connected_components(graph) if len(c) > 1}


def _layering_report(graph: nx.DiGraph) -> list[str]:
    problems = [f"core module {a} imports {b} ({where})"
                for (a, b), where in sorted(layer_violations(graph).items()) if (a, b) not in ALLOWED_IMPORTS]
    problems += ["import cycle: " + "; ".join(edges)
                 for cycle, edges in sorted(import_cycles(graph).items(), key=lambda kv: sorted(kv[0]))
                 if cycle not in ALLOWED_CYCLES]
    return problems


def test_the_core_imports_no_pass_backend_cli_or_debug_module_and_nothing_imports_itself_back():
    problems = _layering_report(import_graph(package_roots()))
    assert not problems, "\n".join(problems)


def test_every_allowed_exception_still_occurs():
    """An allow-list entry whose violation is gone must go too."""
    graph = import_graph(package_roots())
    stale = sorted(ALLOWED_IMPORTS - set(layer_violations(graph)))
    stale += sorted(map(sorted, ALLOWED_CYCLES - set(import_cycles(graph))))
    assert not stale, f"fixed, so remove from the allow-list: {stale}"


def test_the_graph_sees_the_package_dir_mapping_and_function_local_imports():
    graph = import_graph(package_roots())
    assert graph.has_edge("graphopt.passes.cuda_graphs", "graphopt.cuda_graphs")  # passes/ is graphopt.passes
    assert graph.has_edge("graphopt.generation.static", "graphopt.cuda_graphs")  # imported inside a method
    assert graph.has_edge("graphopt.frontend.trace", "graphopt.frontend.dynamo_reuse")  # from pkg import mod
    assert is_core("graphopt.generation.static") and is_core("graphopt.sources.hf")
    assert not is_core("graphopt.debug.reproducer") and not is_core("graphopt.passes.cuda_graphs")


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_it_fails_on_a_planted_violation_and_a_planted_cycle(tmp_path):
    _write(tmp_path, {
        "graphopt/__init__.py": "",
        "graphopt/ops/__init__.py": "from . import a\n",  # relative: graphopt.ops.a
        "graphopt/ops/a.py": "def f():\n    from ..ops import b\n",  # function-local, two dots
        "graphopt/ops/b.py": "import graphopt.ops.a\n",
        "graphopt/core.py": "def run():\n    from graphopt.passes.p import helper\n",
        "graphopt/debug/__init__.py": "",
        "graphopt/debug/tool.py": "from graphopt import core\nfrom graphopt.passes import p\n",  # an application: allowed
        "graphopt/instrument.py": "from graphopt.debug import tool\n",
        "passes/__init__.py": "",
        "passes/p.py": "from graphopt import core\n",
    })
    graph = import_graph({"graphopt": tmp_path / "graphopt", "graphopt.passes": tmp_path / "passes"})
    assert set(layer_violations(graph)) == {("graphopt.core", "graphopt.passes.p"),
                                           ("graphopt.instrument", "graphopt.debug.tool")}
    assert set(import_cycles(graph)) == {frozenset({"graphopt.ops.a", "graphopt.ops.b"}),
                                         frozenset({"graphopt.core", "graphopt.passes.p"})}
    report = _layering_report(graph)
    assert any("graphopt.core imports graphopt.passes.p (graphopt/core.py:2)" in line for line in report)
    assert any(line.startswith("import cycle: graphopt.ops.a -> graphopt.ops.b") for line in report)
