"""Fixtures the pass tests share."""

import pytest

import graphopt.compiler


@pytest.fixture
def final_graph(monkeypatch):
    """Holds the optimized graph the eager target receives (graphs[-1] after a compile)."""
    graphs = []
    lower = graphopt.compiler.lower

    def keep(gm, *args, **kwargs):
        graphs.append(gm)
        return lower(gm, *args, **kwargs)

    monkeypatch.setattr(graphopt.compiler, "lower", keep)
    return graphs
