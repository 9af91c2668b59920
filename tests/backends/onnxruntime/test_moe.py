"""graphopt.moe on ONNX Runtime: the ``MoE`` contrib op against the reference, and transformers'
Mixtral and Qwen2-MoE (small configs) running wholly on ORT, one MoE per layer, at 1e-5 of
eager in fp32, with greedy tokens equal to eager's."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import graphopt
from tests.helpers import assert_matches_eager, eager, small_moe_lm
from tests.op_cases import nonzero_random as r

pytest.importorskip("onnxruntime")
transformers = pytest.importorskip("transformers")

from graphopt.backends.onnxruntime.target import onnxruntime  # noqa: E402
from graphopt.config import Options  # noqa: E402

ORT = Options.parse({"target": "onnxruntime", "fallback": "error"})
LAYERS = 2


@pytest.mark.parametrize("normalize", [True, False], ids=["renormalised", "softmax_weights"])
@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared_expert"])
def test_moe_op_runs_as_ort_moe_and_matches_the_reference(normalize, shared, ort_models):
    # 7 tokens, 5 experts, top 3, inter 6: no size a power of two; shapes mirror OP_CASES["moe"].
    x, wr, gu, d = r(7, 16), r(5, 16), r(5, 12, 16) * 0.3, r(5, 16, 6) * 0.3
    extra = (r(10, 16) * 0.3, r(16, 5) * 0.3, r(1, 16)) if shared else ()

    def fn(*t):
        return torch.ops.graphopt.moe(*t[:4], 3, normalize, *t[4:])

    inputs = [x, wr, gu, d, *extra]
    compiled = onnxruntime.compile(make_fx(fn, tracing_mode="fake")(*inputs), inputs, ORT)
    assert compiled.off_target_ops == []
    assert ort_models[-1].op_histogram().get("com.microsoft::MoE") == 1
    torch.testing.assert_close(compiled(*inputs), fn(*inputs), rtol=1e-5, atol=1e-5)


def _model(family: str, layers: int = LAYERS):
    return small_moe_lm(family, layers)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_transformers_moe_runs_wholly_on_ort_with_one_moe_per_layer(family, ort_models):
    from graphopt.sources import OutputOnly

    model = OutputOnly(_model(family), "logits", causal=True)
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    graphopt.reset()
    compiled = torch.compile(model, backend="graphopt", options={"target": "onnxruntime", "fallback": "error"})
    with torch.no_grad():
        out = compiled(ids)
    assert_matches_eager(out, eager(model, ids), rel=1e-5)
    (report,) = graphopt.reports()
    summary = report.to_dict()
    assert summary["target"] == "onnxruntime" and summary["fallbacks"] == [] and summary["off_target_ops"] == []
    assert report.op_counts.get("graphopt.moe") == LAYERS
    assert "transformers.grouped_mm_fallback" not in report.op_counts
    assert [m.op_histogram().get("com.microsoft::MoE") for m in ort_models] == [LAYERS]


@pytest.mark.parametrize("family", ["mixtral", pytest.param("qwen2_moe", marks=pytest.mark.slow)])
def test_greedy_tokens_on_ort_equal_eager_for_32_steps(family, monkeypatch):
    import graphopt.compiler
    from graphopt import ir
    from graphopt.generation.api import eager_generate

    counts, real = [], graphopt.compiler.run_pipeline

    def counting(*args, **kwargs):  # generate exports through torch.export + the pipeline, no report
        result, ctx = real(*args, **kwargs)
        counts.append(ir.op_counts(result.gm).get("graphopt.moe", 0))
        return result, ctx

    monkeypatch.setattr(graphopt.compiler, "run_pipeline", counting)
    model = _model(family, layers=1)
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(1))
    out = graphopt.generate(model, ids, 32, options={"target": "onnxruntime", "fallback": "error"})
    assert out.target == "onnxruntime" and out.fallback is None
    assert counts and all(c == 1 for c in counts), counts
    assert out.token_ids(0) == eager_generate(model, ids, 32).token_ids(0)
