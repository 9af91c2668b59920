"""The CI fuzz budget: random models through the whole fusion pipeline, checked against eager.

About 150 graphs on the eager target and a dozen on onnxruntime fit in about two minutes on
two cores (each torch.compile costs 0.2-1 s, an ONNX export and session 1-3 s). Graphs are
larger than the CLI's default (up to 10 steps) so each compile checks several patterns.
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
    summary = run_fuzz(150, seed=2024, targets=["eager"], out_dir=tmp_path, settings=LARGER, shrink_budget=15)
    result = summary.to_dict()
    assert summary.graphs == 150 and summary.invalid == 0, result["invalid_examples"]
    assert summary.mismatches == 0 and summary.crashes == 0, failures(summary)
    assert result["no_hits"] == [], result["hits"]
    # a pass that raises on a valid graph is a bug even though the model still runs
    assert [f for f in result["fallbacks"] if f["where"].startswith("pass:")] == []


def test_random_graphs_match_eager_on_onnxruntime(tmp_path):
    if (missing := missing_package()) is not None:  # optional third-party packages; graphopt's module is imported above
        pytest.skip(f"the onnxruntime target needs {missing}: pip install 'graphopt[onnxruntime]'")
    # ONNX Runtime's CPU provider has no bfloat16 kernels: those graphs would only test the fallback
    settings = LARGER.replace(dtypes=("float32", "float16"))
    summary = run_fuzz(12, seed=7, targets=["onnxruntime"], out_dir=tmp_path, settings=settings, shrink_budget=10)
    assert summary.mismatches == 0 and summary.crashes == 0, failures(summary)
    stats = summary.targets["onnxruntime"]
    assert stats.graphs == 12 and stats.fell_back < stats.graphs  # most ran in ONNX Runtime itself


def test_random_graphs_match_eager_on_triton_when_it_can_run(tmp_path):
    from graphopt.fuzz.runner import resolve_targets

    usable, skipped = resolve_targets(["triton"])
    if not usable:
        pytest.skip(f"triton target: {skipped['triton']}")
    # triton 3.9's interpreter rounds float32 -> bfloat16 by truncation (a GPU rounds to nearest),
    # so bfloat16 kernels run there are up to one ulp off: fp32 and fp16 test the kernels fairly
    settings = LARGER.replace(dtypes=("float32", "float16"))
    summary = run_fuzz(10, seed=11, targets=["triton"], out_dir=tmp_path, settings=settings, shrink_budget=10)
    assert summary.mismatches == 0 and summary.crashes == 0, failures(summary)
    assert summary.targets["triton"].fell_back == 0, summary.to_dict()["fallbacks"]
