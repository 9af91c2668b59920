"""Exporting a model prints nothing the user cannot act on."""

import warnings

import torch

from graphopt import models
from graphopt.frontend.trace import export_aten_graph


def test_export_hides_torch_pytree_deprecation():
    # torch.export's run_decompositions deep-copies its module call graph, which trips torch's
    # own `isinstance(treespec, LeafSpec)` FutureWarning on every export of a model with submodules.
    model = models.build("llama-tiny")
    (ids,) = models.example_inputs(model, batch=2, seq_len=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        program = export_aten_graph(model, (ids,))
    assert not [w for w in caught if "LeafSpec" in str(w.message)]
    assert any(n.op == "call_function" for n in program.gm.graph.nodes)  # it did export


def test_other_warnings_still_reach_the_user():
    class Warns(torch.nn.Module):
        def forward(self, x):
            warnings.warn("a model's own warning", FutureWarning)
            return x + 1

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_aten_graph(Warns(), (torch.ones(2),))
    assert any("a model's own warning" in str(w.message) for w in caught)
