"""INT4 experts: ``quantize_int4`` turns ``graphopt.moe`` into ``graphopt.int4_moe`` (its shared
expert into INT4 linears), which ONNX Runtime runs as ``com.microsoft.QMoE``; where the
CPU kernel lacks what the op needs (blocks that do not tile hidden or inter), the op is
decomposed on ORT, and the report says which feature was missing."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import graphopt
from graphopt.ops.moe_int4 import dequantize_experts
from graphopt.ops.quant import dequantize_int4
from graphopt.quant.groupwise import quantize_int4
from tests.helpers import small_moe_lm
from tests.op_cases import nonzero_random as r

pytest.importorskip("onnxruntime")
transformers = pytest.importorskip("transformers")

from graphopt.backends.onnxruntime.target import onnxruntime  # noqa: E402
from graphopt.backends.onnxruntime.lower.translations import int4 as int4_translation  # noqa: E402
from graphopt.config import Options  # noqa: E402

go = torch.ops.graphopt
ORT = Options.parse({"target": "onnxruntime", "fallback": "error"})
# accuracy_level 0: QMoE multiplies by exactly the reference's dequantized weights, only the
# summation order differs (measured <= 1e-5 abs on outputs of magnitude ~5).
TIGHT = dict(rtol=1e-5, atol=2e-5)


@pytest.fixture
def level0(monkeypatch):
    monkeypatch.setattr(int4_translation, "ACCURACY_LEVEL", 0)


def _experts(w: torch.Tensor, symmetric: bool, group: int = 32):
    """(packed, scales, zeros) of stacked expert weights [E, N, K]."""
    e, n, k = w.shape
    q = quantize_int4(w.reshape(e * n, k), group, symmetric, "float32", "rtn")
    zeros = q.zeros.reshape(e, n, -1) if q.zeros is not None else None
    return q.packed.reshape(e, n, -1), q.scales.reshape(e, n, -1), zeros


def _op_call(hidden: int, inter: int, symmetric: bool, normalize: bool = True, k: int = 3):
    """(fn, inputs, fp32 fn): 7 tokens, 5 experts, top ``k``; ``fp32 fn`` is graphopt.moe on the
    unquantized experts (the same routing: the router stays fp32)."""
    x, wr = r(7, hidden), r(5, hidden)
    gate_up, down = r(5, 2 * inter, hidden) * 0.3, r(5, hidden, inter) * 0.3
    (p1, s1, z1), (p2, s2, z2) = _experts(gate_up, symmetric), _experts(down, symmetric)
    tensors = [t for t in (x, wr, p1, s1, z1, p2, s2, z2) if t is not None]

    def fn(*t):
        if symmetric:
            x, wr, p1, s1, p2, s2 = t
            return go.int4_moe(x, wr, p1, s1, None, p2, s2, None, 32, k, normalize)
        return go.int4_moe(*t, 32, k, normalize)

    return fn, tensors, lambda: go.moe(x, wr, gate_up, down, k, normalize)


def _qmoe_attributes(model) -> list[dict]:
    return [{a.name: a.value for a in node.attributes.values()} for node in model.model.graph if node.op_type == "QMoE"]


def test_reference_dequantizes_each_expert_as_int4_linear_does():
    w = r(3, 40, 96)
    for symmetric in (True, False):
        packed, scales, zeros = _experts(w, symmetric)
        got = dequantize_experts(packed, scales, zeros, 32, 90)  # 90 of 96: the padding is cut
        for e in range(3):
            want = dequantize_int4(packed[e], scales[e], zeros[e] if zeros is not None else None, 32, 90)
            assert torch.equal(got[e], want)


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "zero_points"])
@pytest.mark.parametrize("normalize", [True, False], ids=["renormalised", "softmax_weights"])
def test_int4_moe_runs_as_qmoe_and_matches_the_dequantized_reference(symmetric, normalize, ort_models, level0):
    fn, inputs, fp32 = _op_call(hidden=64, inter=32, symmetric=symmetric, normalize=normalize)
    compiled = onnxruntime.compile(make_fx(fn, tracing_mode="fake")(*inputs), inputs, ORT)
    assert compiled.off_target_ops == []
    histogram = ort_models[-1].op_histogram()
    assert histogram.get("com.microsoft::QMoE") == 1 and "com.microsoft::MoE" not in histogram
    (attrs,) = _qmoe_attributes(ort_models[-1])
    assert (attrs["expert_weight_bits"], attrs["block_size"], attrs["swiglu_fusion"], attrs["weights_prepacked"],
            attrs["k"], attrs["normalize_routing_weights"]) == (4, 32, 1, 0, 3, int(normalize))
    got, want = compiled(*inputs), fn(*inputs)
    torch.testing.assert_close(got, want, **TIGHT)
    # Against the fp32 experts: only the 4-bit weight error (routing is the same): measured
    # 14-17% relative on these Gaussian weights (about 9% error per weight, through two GEMMs).
    assert (got - fp32()).norm() / fp32().norm() < 0.25


def test_default_accuracy_level_runs_int8_activations_within_their_error(ort_models):
    assert int4_translation.ACCURACY_LEVEL == 4
    fn, inputs, _ = _op_call(hidden=64, inter=32, symmetric=True)
    compiled = onnxruntime.compile(make_fx(fn, tracing_mode="fake")(*inputs), inputs, ORT)
    assert _qmoe_attributes(ort_models[-1])[0]["accuracy_level"] == 4
    got, want = compiled(*inputs), fn(*inputs)
    assert (got - want).norm() / want.norm() < 3e-2  # x quantized to int8 per block: measured ~1e-2


def test_skips_qmoe_when_blocks_do_not_tile_inter_and_decomposes_on_ort(ort_models, level0):
    # inter 48 with group 32: the codes are padded to 64, which QMoE's CPU kernel cannot read.
    fn, inputs, _ = _op_call(hidden=64, inter=48, symmetric=True)
    compiled = onnxruntime.compile(make_fx(fn, tracing_mode="fake")(*inputs), inputs, ORT)
    (row,) = compiled.off_target_ops
    assert row["op"] == "graphopt.int4_moe" and row["how"] == "decomposed"
    assert "QMoE kernel lacks padded blocks: hidden 64 and inter 48 must be multiples of group_size 32" in row["reason"]
    assert {p["where"] for p in compiled.partitions} == {"onnxruntime"}
    assert "com.microsoft::QMoE" not in ort_models[-1].op_histogram()
    torch.testing.assert_close(compiled(*inputs), fn(*inputs), **TIGHT)


# --- through the pipeline: transformers' Mixtral and Qwen2-MoE with int4 on ---------------

LAYERS = 2
# Leave attention and the head in full precision: the comparison with fp32 then measures
# the experts' (and shared expert's) 4 bits only.
EXPERTS_ONLY = {"search": "rtn", "skip": ["*self_attn*", "*lm_head*"]}


def _model(family: str):
    # QMoE takes only whole blocks of 32: hidden 64, expert inter 32, shared inter 64.
    return small_moe_lm(family, LAYERS, hidden=64, inter=64, moe_inter=32, shared_inter=64)


def _compiled(model, target: str, int4: bool):
    torch._dynamo.reset()
    graphopt.reset()
    options = {"target": target, "fallback": "error"}
    if int4:
        options.update(int4=True, pass_options={"quantize_int4": EXPERTS_ONLY})
    return torch.compile(model, backend="graphopt", options=options)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_transformers_moe_with_int4_experts_runs_as_qmoe(family, ort_models, level0):
    from graphopt.sources import OutputOnly

    model = OutputOnly(_model(family), "logits", causal=True)
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = _compiled(model, "onnxruntime", int4=True)(ids)
        (report,) = graphopt.reports()
        reference = _compiled(model, "eager", int4=True)(ids)  # the same quantized graph, reference ops
        fp32 = model(ids)
    summary = report.to_dict()
    assert summary["fallbacks"] == [] and summary["off_target_ops"] == []
    assert report.op_counts.get("graphopt.int4_moe") == LAYERS and "graphopt.moe" not in report.op_counts
    # Qwen2-MoE's shared expert: two INT4 linears per layer beside the QMoE (its gate stays fp32).
    assert report.op_counts.get("graphopt.int4_linear", 0) == (2 * LAYERS if family == "qwen2_moe" else 0)
    assert [m.op_histogram().get("com.microsoft::QMoE") for m in ort_models] == [LAYERS]
    torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-4)
    # 4-bit experts against fp32: measured 2-3% relative on the logits of these random weights.
    assert (got - fp32).norm() / fp32.norm() < 0.08
    stats = next(p for p in report.passes if p.name == "quantize_int4").stats
    experts = [layer for layer in stats["layers"] if ".experts." in layer["name"]]
    assert stats["moe_layers"] == LAYERS and len(experts) == 2 * LAYERS
    assert all(layer["bits"] == 4 and layer["bytes_after"] < 0.2 * layer["bytes_fp32"] for layer in experts)


def test_skip_pattern_leaves_the_experts_in_full_precision():
    from graphopt.sources import OutputOnly

    model = OutputOnly(_model("mixtral"), "logits", causal=True)
    ids = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    graphopt.reset()
    options = {"target": "eager", "int4": True,
               "pass_options": {"quantize_int4": {"search": "rtn", "skip": ["*experts*"]}}}
    with torch.no_grad():
        torch.compile(model, backend="graphopt", options=options)(ids)
    (report,) = graphopt.reports()
    assert report.op_counts.get("graphopt.moe") == LAYERS and "graphopt.int4_moe" not in report.op_counts
    stats = next(p for p in report.passes if p.name == "quantize_int4").stats
    assert stats["moe_layers"] == 0
