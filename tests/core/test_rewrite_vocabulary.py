"""One matching vocabulary: passes name ATen op sets from ``graphopt.rewrite``, never their own.

A module-level tuple, list or set literal in a pass that spells ``aten.<op>.<overload>``
is a private op set: the next spelling (another view op, another softmax overload) would
then have to be added in every copy. Tables with a value per op (a reason, an identity
constant) are pattern data, not op sets, and are allowed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from graphopt.rewrite import aten_ops

ROOT = Path(__file__).resolve().parents[2]
MATCHING_MODULES = sorted((ROOT / "passes").glob("*.py")) + [ROOT / "graphopt" / "rewrite" / "linears.py"]


def _aten_refs(node: ast.AST) -> list[str]:
    """``aten.X.Y`` / ``torch.ops.aten.X.Y`` attribute chains directly inside ``node``."""
    found = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Attribute):
            base = sub.value.value
            if (isinstance(base, ast.Name) and base.id == "aten") or (
                    isinstance(base, ast.Attribute) and base.attr == "aten"):
                found.append(f"aten.{sub.value.attr}.{sub.attr}")
    return found


def _op_sets(tree: ast.Module) -> list[tuple[int, str, list[str]]]:
    """(line, name, ops) of every module-level collection literal holding ATen ops."""
    sets = []
    for stmt in tree.body:
        if not isinstance(stmt, (ast.Assign, ast.AnnAssign)) or stmt.value is None:
            continue
        value = stmt.value
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in (
                "frozenset", "set", "tuple", "list") and value.args:
            value = value.args[0]
        if not isinstance(value, (ast.Tuple, ast.List, ast.Set)):
            continue
        ops = _aten_refs(value)
        if ops:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            sets.append((stmt.lineno, ast.unparse(targets[0]), ops))
    return sets


@pytest.mark.parametrize("path", MATCHING_MODULES, ids=lambda p: p.name)
def test_pass_defines_no_aten_op_set(path):
    own = _op_sets(ast.parse(path.read_text()))
    assert not own, (f"{path.name} defines its own ATen op set(s) {own}: "
                     "name them in graphopt/rewrite/aten_ops.py and import them from graphopt.rewrite")


def test_the_check_catches_a_private_op_set():
    planted = ast.parse("import torch\naten = torch.ops.aten\n_VIEWS = (aten.view.default, aten.reshape.default)\n")
    assert _op_sets(planted) == [(3, "_VIEWS", ["aten.view.default", "aten.reshape.default"])]


def test_vocabulary_sets_hold_real_ops():
    for name in dir(aten_ops):
        value = getattr(aten_ops, name)
        if name.isupper() and isinstance(value, (tuple, dict)):
            for op in value:
                assert isinstance(op, torch._ops.OpOverload), f"{name} holds {op!r}, not an ATen overload"


def test_commuted_picks_the_matching_operand():
    import torch.fx as fx

    from graphopt.rewrite import NoMatch, commuted, is_op

    graph = fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    sig = graph.call_function(torch.ops.aten.sigmoid.default, (x,))
    mul = graph.call_function(torch.ops.aten.mul.Tensor, (y, sig))
    assert commuted(mul, lambda n: is_op(n, torch.ops.aten.sigmoid.default), "a sigmoid") == (sig, y)
    plain = graph.call_function(torch.ops.aten.mul.Tensor, (x, y))
    with pytest.raises(NoMatch, match=f"neither operand of {plain.name} is a sigmoid"):
        commuted(plain, lambda n: is_op(n, torch.ops.aten.sigmoid.default), "a sigmoid")
