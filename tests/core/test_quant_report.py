"""graphopt.quant.report: logits error, top-1 agreement, and the INT4 summary of a report."""

import pytest
import torch
from torch import nn

from graphopt.quant.report import int4_summary, layer_rows, logits_metrics, top1_agreement
from tests.helpers import compile_with_graphopt


def test_logits_metrics():
    ref = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 1.0]])
    got = torch.tensor([[1.0, 2.5, 0.0], [0.0, 3.0, 1.0]])  # row 2's argmax moves
    m = logits_metrics(got, ref)
    assert m["top1_agreement"] == 0.5
    assert m["max_abs_error"] == 3.0
    assert m["rel_error"] == pytest.approx((0.25 + 9 + 9) ** 0.5 / (1 + 4 + 9 + 1) ** 0.5)
    assert logits_metrics(ref, ref) == {"rel_error": 0.0, "max_abs_error": 0.0, "top1_agreement": 1.0}


def test_shape_mismatch_fails_with_one_line():
    with pytest.raises(ValueError, match="differ in shape"):
        top1_agreement(torch.zeros(2, 3), torch.zeros(3, 3))


def test_int4_summary_of_a_compile_report():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32, bias=False))
    _, report = compile_with_graphopt(module, torch.randn(4, 64), passes=["canonicalize", "quantize_int4"],
                                      pass_options={"quantize_int4": {"group_size": 64, "symmetric": False, "scale_dtype": "float16",
                                                                     "head_bits": 4, "search": "gptq"}})
    for source in (report, report.to_dict(), [report]):
        summary = int4_summary(source)
        assert summary["quantized_weights"] == 2
        assert summary["weight_bytes_fp32"] == (64 * 128 + 128 * 32) * 4
        # codes + fp16 scales + zero points (two a byte: one group's row of 64 still takes a byte).
        after = (128 * 32 + 128 * 2 + 128 * 1) + (32 * 64 + 32 * 2 * 2 + 32 * 1)
        assert summary["weight_bytes_after"] == after
        assert summary["bytes_ratio_fp32"] == pytest.approx(after / summary["weight_bytes_fp32"])
        assert 0 < summary["mean_rel_error"] <= summary["max_rel_error"] < 0.12
    rows = layer_rows(int4_summary(report))
    assert [r[1:5] for r in rows] == [["128x64", 4, 64, False], ["32x128", 4, 64, False]]
    assert all(0 < r[6] < 0.05 for r in rows)  # output error on the calibration inputs (gptq)


def test_int4_summary_is_none_without_the_pass():
    _, report = compile_with_graphopt(nn.Linear(8, 8), torch.randn(2, 8), passes=["canonicalize"])
    assert int4_summary(report) is None
