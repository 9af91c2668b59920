"""Every generated case runs at two shapes through one compile: a pass that specializes
the graph to its first shape is caught at the second; a correct pipeline passes both."""

from __future__ import annotations

from graphopt.fuzz.generate import Settings
from graphopt.fuzz.runner import case_for, run_fuzz
from graphopt.fuzz.shapes import candidate_axes, second_shape
from graphopt.fuzz.source import materialize
from graphopt.registry import scoped_passes
from tests.fuzz.planted_bugs import BakeSizes

# attention and reshapes read batch and sequence from their inputs: the graphs carry symbolic sizes
SIZED = Settings(min_steps=2, max_steps=4, plant_percent=60, only=("plant_attention", "linear", "reshape", "silu"))


def test_a_pass_that_bakes_in_the_first_shape_fails_at_the_second():
    with scoped_passes(BakeSizes()):
        summary = run_fuzz(2, seed=3, targets=["eager"], settings=SIZED, pipeline=["bake_sizes"], shrink_budget=0)
    assert summary.multi_shape == 2 and summary.hits["bake_sizes"] >= 2
    assert summary.crashes + summary.mismatches == 2
    for failure in summary.failures:  # right at the first shape, so only the second can show it
        assert failure.detail.startswith(("at sequence ", "at batch ")) and "(compiled at " in failure.detail


def test_one_compile_serves_both_shapes_when_nothing_specializes():
    summary = run_fuzz(2, seed=3, targets=["eager"], settings=SIZED, pipeline=["canonicalize"], shrink_budget=0)
    stats = summary.targets["eager"]
    assert summary.multi_shape == 2 and summary.mismatches == summary.crashes == 0
    assert stats.recompiled == 0, "a second shape of sizes >= 2 must reuse the first compile"


def test_sequence_is_tried_before_batch_and_sizes_of_one_last():
    case = case_for(3, 0, SIZED)
    b, s = case.inputs[0].value.shape[:2]
    assert candidate_axes(case)[0] == (("sequence", s, s + 2) if s >= 2 else ("batch", b, b + 1))
    module, inputs, _ = materialize(case)
    shape, why = second_shape(case, module)
    assert why == "" and shape.inputs[0].shape != inputs[0].shape
    assert shape.ref.problem is None  # eager ran the resized inputs: they are a valid second call
