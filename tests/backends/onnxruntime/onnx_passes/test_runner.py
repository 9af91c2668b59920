"""onnx_passes.runner: the ONNX-level rewrites run as passes, with the report entries FX passes get
(name, rewrites, time, node counts, near misses), and an ONNX Runtime compile lists them."""

import pytest
import torch
from torch import nn

from tests.backends.onnxruntime import _helpers  # noqa: F401  (skips without onnxruntime)

import graphopt  # noqa: E402
from graphopt.backends.onnxruntime.onnx_passes import matmul_reshapes  # noqa: E402
from graphopt.backends.onnxruntime.onnx_passes.runner import OnnxPassResult, Refusal, run_onnx_passes  # noqa: E402
from tests.backends.onnxruntime.onnx_passes.test_matmul_reshapes import N, _model  # noqa: E402
from tests.helpers import assert_matches_eager  # noqa: E402


def test_a_fold_is_recorded_as_a_changed_pass():
    model = _model()
    done = run_onnx_passes(model, [matmul_reshapes.fold_flattened_matmuls_pass])
    (record,) = done.records
    assert (record.name, record.status, record.matches, record.near_misses) == (
        "onnx:fold_flattened_matmuls", "changed", 1, 0)
    assert record.stats == {"matches": 1}
    assert (record.nodes_before, record.nodes_after) == (5, 1)
    assert record.time_ms > 0
    assert done.near_misses == []


def test_a_refused_candidate_is_a_near_miss_with_its_reason():
    model = _model(unflatten_dims=("S", "B", N))  # the unflatten swaps the leading axes
    done = run_onnx_passes(model, [matmul_reshapes.fold_flattened_matmuls_pass])
    (record,) = done.records
    assert (record.status, record.matches, record.near_misses) == ("unchanged", 0, 1)
    (miss,) = done.near_misses
    matmul = next(n for n in model.graph if n.op_type == "MatMul")
    assert (miss.pass_name, miss.anchor) == ("onnx:fold_flattened_matmuls", matmul.name)
    assert "do more than flatten and unflatten the leading axes" in miss.reason


class _Explodes:
    name = "explodes"
    summary = "raises"

    def run(self, model):
        raise RuntimeError("boom")


class _Counts:
    name = "counts"
    summary = "claims two rewrites"

    def run(self, model):
        return OnnxPassResult(2, {"kinds": 2}, [Refusal("graph", "one left")])


def test_passes_run_in_order_and_a_failing_one_raises_after_its_record():
    model = _model()
    done = run_onnx_passes(model, [_Counts()])
    assert [(r.name, r.matches, r.stats) for r in done.records] == [("onnx:counts", 2, {"matches": 2, "kinds": 2})]
    with pytest.raises(RuntimeError, match="boom"):
        run_onnx_passes(model, [_Counts(), _Explodes()])


class _Projection(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 6, bias=False)  # view / mm / view: no bias Add between mm and the unflatten

    def forward(self, x):
        return torch.relu(self.proj(x))


def test_an_onnxruntime_compile_reports_its_onnx_passes():
    torch.manual_seed(0)
    model, x = _Projection().eval(), torch.randn(2, 5, 8)
    graphopt.reset()
    compiled = torch.compile(model, backend="graphopt", options={"target": "onnxruntime"})
    with torch.no_grad():
        assert_matches_eager(compiled(x), model(x), rel=1e-5)
    (report,) = graphopt.reports()
    assert report.target == "onnxruntime"
    records = {r.name: r for r in report.passes if r.name.startswith("onnx:")}
    assert set(records) >= {"onnx:fold_flattened_matmuls", "onnx:light_cleanup", "onnx:tidy_attention_layout",
                            "onnx:trim_unused_outputs", "onnx:match_output_dtypes"}
    assert records["onnx:fold_flattened_matmuls"].matches == 1  # the Linear's view / mm / view
    assert records["onnx:fold_flattened_matmuls"].status == "changed"
    # the FX pipeline's passes come first, then the ONNX passes of the one build
    names = [r.name for r in report.passes]
    first_onnx = next(i for i, n in enumerate(names) if n.startswith("onnx:"))
    assert all(n.startswith("onnx:") for n in names[first_onnx:])
    assert "onnx:fold_flattened_matmuls" in [p["name"] for p in report.to_dict()["passes"]]
