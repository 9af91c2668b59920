"""The CI fuzz budget: random models through the whole fusion pipeline, checked against eager.

About 60 graphs on the eager target and a dozen on onnxruntime fit in a few minutes on
two cores (each torch.compile costs 0.2-1 s, an ONNX export and session 1-3 s). Graphs are
larger than the CLI's default (up to 10 steps) so each compile checks several patterns.
Every graph is compiled once and called at two shapes (``graphopt.fuzz.shapes``).
The triton case runs in tests/backends/triton/test_fuzz.py, under TRITON_INTERPRET=1.
The long run is one command: ``graphopt fuzz --graphs 500 --seed 0 --json``.
"""

import pytest

from graphopt.backends.onnxruntime.target import missing_package
from graphopt.fuzz.generate import Settings
from graphopt.fuzz.runner import run_fuzz

LARGER = Settings(min_steps=4, max_steps=10)


def failures(summary) -> str:
    return "\n".join(f"{f.status} on {f.target}: {f.detail} [{f.case}] {f.reproducer}" for f in summary.failures)


def test_random_graphs_match_eager_on_the_eager_target(tmp_path):
    summary = run_fuzz(60, seed=2024, targets=["eager"], out_dir=tmp_path, settings=LARGER, shrink_budget=15)
    result = summary.to_dict()
    assert summary.graphs == 60 and summary.invalid == 0, result["invalid_examples"]
    assert summary.mismatches == 0 and summary.crashes == 0, failures(summary)
    # the fuzzer plants no collectives: the all-reduce fusion is checked by its own tests
    # (tests/passes/test_fuse_all_reduce_add_rms_norm.py, tests/distributed)
    assert [p for p in result["no_hits"] if p != "fuse_all_reduce_add_rms_norm"] == [], result["hits"]
    # nothing falls back on the eager target: a pass that raises on a valid graph is a bug
    # even though the model still runs
    assert result["fallbacks"] == []
    # 59 of 60 run at a second length; the other has a weight or a norm sized along its
    # only batch/sequence axis, so no second shape exists for it
    assert summary.multi_shape >= 59, result["single_shape_examples"]
    assert summary.targets["eager"].recompiled == 0, "a second shape of sizes >= 2 must reuse the first compile"


def test_random_graphs_match_eager_on_onnxruntime(tmp_path):
    if (missing := missing_package()) is not None:  # optional third-party packages; graphopt's module is imported above
        pytest.skip(f"the onnxruntime target needs {missing}: pip install 'graphopt[onnxruntime]'")
    # ONNX Runtime's CPU provider has no bfloat16 kernels: those graphs would only test the fallback
    settings = LARGER.replace(dtypes=("float32", "float16"))
    summary = run_fuzz(12, seed=7, targets=["onnxruntime"], out_dir=tmp_path, settings=settings, shrink_budget=10)
    assert summary.mismatches == 0 and summary.crashes == 0, failures(summary)
    stats = summary.targets["onnxruntime"]
    # every graph runs in ONNX Runtime itself: no pass and no op falls back to eager
    assert stats.graphs == 12 and summary.to_dict()["fallbacks"] == []
    assert summary.multi_shape >= 11, summary.single_shape_examples  # graph 5's norm spans its sequence axis
    assert stats.recompiled == 0, "a second shape of sizes >= 2 must reuse the first compile"
