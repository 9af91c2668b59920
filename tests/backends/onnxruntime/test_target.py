"""The onnxruntime target through torch.compile: real models match eager, the exported
models hold ORT's fused ops, and every way it cannot run falls back with a reason."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import graphopt
from graphopt import models
from graphopt.backends.onnxruntime.lower import onnx_model
from graphopt.backends.onnxruntime import target as target_module
from graphopt.config import Options
from graphopt.pipeline import DEFAULT_PIPELINE
from graphopt.registry import all_passes
from graphopt.targets import resolve_target
from tests.backends.onnxruntime._helpers import rel_err  # noqa: F401  (skips without onnxruntime)
from tests.helpers import assert_matches_eager, eager

# The default pipeline plus the rope and attention fusions (where registered): every
# graphopt op a Llama can have, so every lowering runs.
PIPELINE = list(DEFAULT_PIPELINE) + [p for p in ("fuse_rope", "fuse_attention")
                                     if p in all_passes() and p not in DEFAULT_PIPELINE]
ORT_OP_FOR = {  # graphopt op -> the ORT op(s) it must become
    "graphopt.rms_norm": ("SimplifiedLayerNormalization",),
    "graphopt.add_rms_norm": ("com.microsoft::SkipSimplifiedLayerNormalization",),
    "graphopt.layer_norm": ("LayerNormalization",),
    "graphopt.add_layer_norm": ("com.microsoft::SkipLayerNormalization",),
    "graphopt.rope": ("com.microsoft::RotaryEmbedding",),
    "graphopt.attention": ("com.microsoft::GroupQueryAttention", "com.microsoft::MultiHeadAttention"),
}


@pytest.fixture
def exported(ort_models):
    """The ONNX models the target exports during a test, in order (conftest.py)."""
    return ort_models


def compile_on_ort(module, *inputs, **options):
    torch._dynamo.reset()
    graphopt.reset()
    opts = {"target": "onnxruntime", "provider": "cpu", "fallback": "error", "pipeline": PIPELINE, **options}
    compiled = torch.compile(module, backend="graphopt", options=opts)
    with torch.no_grad():
        return compiled(*inputs), graphopt.reports()


def assert_lowered_to_fused_ops(report, model) -> None:
    histogram = model.op_histogram()
    for op, ort_ops in ORT_OP_FOR.items():
        assert sum(histogram.get(o, 0) for o in ort_ops) == report.op_counts.get(op, 0), (op, histogram)


def test_llama_tiny_matches_eager_with_fused_ort_ops(exported):
    model = models.build("llama-tiny")
    (ids,) = models.example_inputs(model, batch=2, seq_len=12)
    out, (report,) = compile_on_ort(model, ids)
    assert_matches_eager(out, eager(model, ids), rel=1e-4)  # logits and the KV cache
    assert report.target == "onnxruntime" and not report.fallbacks
    assert report.op_counts["graphopt.rms_norm"] >= 1 and report.op_counts["graphopt.add_rms_norm"] >= 1
    (onnx_model,) = exported
    assert_lowered_to_fused_ops(report, onnx_model)
    assert onnx_model.fused_op_counts()["com.microsoft::SkipSimplifiedLayerNormalization"] == 4


def test_bert_tiny_matches_eager(exported):
    model = models.build("bert-tiny")
    ids, mask = models.example_inputs(model, batch=2, seq_len=10)
    mask[1, 7:] = 0  # padding in the second row
    out, (report,) = compile_on_ort(model, ids, mask)
    assert_matches_eager(out, eager(model, ids, mask), rel=1e-4)
    assert report.target == "onnxruntime" and not report.fallbacks
    assert_lowered_to_fused_ops(report, exported[0])


def test_transformers_llama_matches_eager():
    transformers = pytest.importorskip("transformers")
    from graphopt.sources import OutputOnly

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = OutputOnly(transformers.LlamaForCausalLM(config).eval(), "logits", causal=True)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    out, reports = compile_on_ort(model, ids)
    assert_matches_eager(out, eager(model, ids), rel=1e-4)
    assert {r.target for r in reports} == {"onnxruntime"} and not any(r.fallbacks for r in reports)


# --- what cannot run falls back, and says why ------------------------------------------


@torch.library.custom_op("graphopt::ort_test_untranslated", mutates_args=())
def untranslated(x: torch.Tensor) -> torch.Tensor:
    """A graphopt op no translation module knows (stands for an op added before its lowering)."""
    return x * 3


untranslated.register_fake(lambda x: torch.empty_like(x))


@torch.library.custom_op("graphopt_test::ort_mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    """A third-party op the ONNX exporter has no function for."""
    return x.sin()


mystery.register_fake(lambda x: torch.empty_like(x))


@pytest.mark.parametrize("op, name, how", [
    (torch.ops.graphopt.ort_test_untranslated, "graphopt.ort_test_untranslated", "decomposed"),
    (torch.ops.graphopt_test.ort_mystery, "graphopt_test.ort_mystery", "eager"),
])
def test_op_without_translation_leaves_the_rest_on_ort_naming_it(op, name, how):
    # A graphopt op becomes its reference's ATen ops; a foreign op runs eagerly between two ORT parts.
    class UsesOp(torch.nn.Module):
        def forward(self, x):
            return op(x + 1) * 2

    x = torch.randn(3, 8)
    out, (report,) = compile_on_ort(UsesOp(), x, fallback="error")
    assert_matches_eager(out, eager(UsesOp(), x), rel=1e-6)
    assert report.target == "onnxruntime" and report.fallbacks == []
    (row,) = report.to_dict()["off_target_ops"]
    assert (row["op"], row["count"], row["how"]) == (name, 1, how)


def test_graph_of_only_an_unexportable_op_falls_back_naming_it(caplog):
    class OnlyOp(torch.nn.Module):
        def forward(self, x):
            return torch.ops.graphopt_test.ort_mystery(x)

    x = torch.randn(3, 8)
    out, (report,) = compile_on_ort(OnlyOp(), x, fallback="eager")
    assert_matches_eager(out, eager(OnlyOp(), x), rel=1e-6)
    assert report.target == "eager"
    (fallback,) = report.fallbacks
    assert fallback["where"] == "target:onnxruntime"
    assert "op graphopt_test.ort_mystery cannot be exported" in fallback["reason"]
    assert "graphopt_test.ort_mystery" in caplog.text


def test_provider_not_installed_says_which_package():
    reason = target_module.onnxruntime.unavailable_reason(Options(target="onnxruntime", provider="cuda"))
    assert reason == "provider cuda needs onnxruntime-gpu: pip install onnxruntime-gpu"
    x = torch.randn(2, 4)
    out, (report,) = compile_on_ort(torch.nn.Tanh(), x, provider="cuda", fallback="eager")
    assert torch.equal(out, torch.tanh(x))
    assert "provider cuda needs onnxruntime-gpu" in report.fallbacks[0]["reason"]


@pytest.mark.parametrize("package", ["onnxruntime", "onnxscript"])
def test_missing_package_is_named_and_auto_moves_on(monkeypatch, package):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    reason = target_module.onnxruntime.unavailable_reason(Options())
    assert reason == f"needs the Python package {package!r}: pip install 'graphopt[onnxruntime]'"
    monkeypatch.setattr("graphopt.targets.detect_hardware", lambda: "cpu")
    target, skipped = resolve_target(Options(target="auto"))
    assert target.name == "eager" and skipped == [f"onnxruntime: {reason}"]


def test_auto_on_a_cpu_machine_runs_onnxruntime(monkeypatch):
    monkeypatch.setattr("graphopt.targets.detect_hardware", lambda: "cpu")
    x = torch.randn(4, 16)
    out, (report,) = compile_on_ort(torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.GELU()), x, target="auto")
    assert report.target == "onnxruntime"
    assert out.shape == (4, 8)


def test_model_over_the_protobuf_limit_loads_from_external_data(monkeypatch, exported):
    monkeypatch.setattr(onnx_model, "LARGE_MODEL_BYTES", 100)  # the Linear's 512 bytes count as large
    module = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh())
    x = torch.randn(4, 16)
    out, (report,) = compile_on_ort(module, x)
    assert report.target == "onnxruntime" and exported[0].is_large()
    assert_matches_eager(out, eager(module, x), rel=1e-5)


def _fallback_reasons(model, x) -> list[str]:
    """Compile ``model`` on onnxruntime, check the (eager fallback's) output, return the reasons."""
    graphopt.reset()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="graphopt", options={"target": "onnxruntime"})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))  # fell back to eager
    return [fb["reason"] for r in graphopt.reports() for fb in r.fallbacks]


def test_a_missing_bfloat16_kernel_is_one_line_that_names_the_fix():
    """Found by graphopt fuzz: ORT's CPU provider has no bfloat16 MatMul; the fallback reason
    used to be ORT's raw NOT_IMPLEMENTED text."""
    reasons = _fallback_reasons(torch.nn.Linear(16, 8).to(torch.bfloat16).eval(),
                                torch.randn(2, 16, dtype=torch.bfloat16))
    assert any("ONNX Runtime's cpu provider has no bfloat16 kernel for" in r and "model.float()" in r
               for r in reasons), reasons


def test_a_bfloat16_cast_in_an_fp32_model_is_named_as_the_model_s_own():
    """An fp32 model whose code casts to bfloat16 itself (Falcon's ALiBi) gains nothing from
    model.float(): the reason says the bfloat16 is the model's own."""

    class CastsItself(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(16, 8)

        def forward(self, x):
            return self.linear(x) * (x[:, :8].bfloat16() * 3).float()

    reasons = _fallback_reasons(CastsItself().eval(), torch.randn(2, 16))
    assert any("no bfloat16 kernel for Mul" in r and "own code" in r and "model.float()" not in r
               for r in reasons), reasons
