"""Bugs the fuzzer found, each as the smallest module that shows it.

Fixed bugs are plain tests. Bugs whose fix belongs to another part of graphopt are marked
``xfail(strict=True)`` with the reason, so the test starts failing (XPASS) the day the bug is
fixed and the marker must go.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphopt
from graphopt.backends.onnxruntime.target import missing_package
from graphopt.fuzz.check import check_module


class NativeLayerNormStats(nn.Module):
    """Minimized from `graphopt fuzz --seed 0` graph 109 (a LayerNorm whose mean is also read)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(32, dtype=torch.float16), requires_grad=False)

    def forward(self, x):
        out, mean, _ = torch.native_layer_norm(x, [32], self.weight, None, 1e-6)
        return out, mean


def test_onnxruntime_keeps_the_dtype_of_native_layer_norm_stats():
    """torch.onnx computes native_layer_norm's mean/rstd of a float16 input in float32; the
    exported model now casts its outputs back to the dtypes eager returns."""
    if (missing := missing_package()) is not None:  # optional third-party packages; graphopt's module is imported above
        pytest.skip(f"the onnxruntime target needs {missing}: pip install 'graphopt[onnxruntime]'")
    x = torch.randn(1, 1, 32).half()
    outcome = check_module(NativeLayerNormStats(), (x,), "onnxruntime", ["canonicalize"], "float16")
    assert outcome.ran_on == ["onnxruntime"] and outcome.status == "ok", outcome.line()


def test_compile_checks_pass_names_at_once():
    """Found by the fuzzer: an unknown pass used to fail only at the first call."""
    with pytest.raises(graphopt.OptionsError, match="unknown pass 'nosuch'"):
        graphopt.compile(nn.Linear(2, 2), {"pipeline": ["nosuch"]})
