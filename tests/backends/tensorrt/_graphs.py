"""Graphs and inputs for the tensorrt tests: one small call per graphopt op, and the
pipeline's optimized graphs for the reference models."""

from __future__ import annotations

import functools


from graphopt import models
from graphopt.compiler import run_pipeline
from graphopt.config import Options
from graphopt.frontend.trace import capture_aten_graphs
from tests.op_cases import OP_CASES, nonzero_random

# Every graphopt op, one small call each (shared with the other targets' tests).
CASES = OP_CASES
random = nonzero_random


@functools.cache
def _optimized(name: str):
    model = models.build(name)
    inputs = models.example_inputs(model, batch=2, seq_len=8)
    (captured,) = capture_aten_graphs(model, inputs)
    result, _ = run_pipeline(captured.gm, Options.parse({"target": "eager"}), captured.example_inputs)
    return result.gm, captured.example_inputs


def optimized_graph(name: str):
    """(the default pipeline's graph for ``name`` at batch 2, seq 8; its capture inputs).
    Cached: callers copy the graph before changing it."""
    return _optimized(name)


def fresh_inputs(name: str) -> tuple:
    """Other inputs of the same shapes: new token ids, and for BERT a mask that pads the
    end of the second sequence, so the mask path computes something."""
    ids = models.example_inputs(name, batch=2, seq_len=8, seed=1)
    if name.startswith("bert"):
        ids, mask = ids
        mask = mask.clone()
        mask[1, -3:] = 0
        return ids, mask
    return ids
