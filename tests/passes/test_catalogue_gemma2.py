"""transformers' Gemma2ForCausalLM (small config, random weights) on the onnxruntime target:
every norm, gated MLP and soft-capped attention fuses, the exported model holds ORT's fused
ops (GroupQueryAttention with its ``softcap``), and the logits match eager.

Gemma2 is the catalogue's soft-capping family: ``attn_logit_softcapping`` caps the attention
scores before the mask (fuse_attention -> graphopt.attention(..., softcap)), its RMSNorm
scales by (1 + w), it has four norms per layer, and it alternates sliding-window and full
attention layers. Both kinds reach the attention op with a materialized additive mask (the
eager attention transformers runs for softcapping); the ORT lowering passes that mask as
GroupQueryAttention's ``attention_bias``, so the sliding window is in the bias and GQA's
``local_window_size`` stays unused.
"""

from __future__ import annotations

import pytest
import torch

import graphopt
from graphopt.backends.onnxruntime.lower import export as export_module
from tests.backends.onnxruntime._helpers import rel_err  # noqa: F401  (skips without onnxruntime)
from tests.helpers import assert_matches_eager, count, eager

transformers = pytest.importorskip("transformers")

LAYERS, ATTN_CAP, FINAL_CAP, WINDOW = 2, 50.0, 30.0, 4
GQA = "com.microsoft::GroupQueryAttention"


class Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids, use_cache=False).logits


@pytest.fixture(scope="module")
def gemma2():
    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=128, attn_logit_softcapping=ATTN_CAP,
        final_logit_softcapping=FINAL_CAP, sliding_window=WINDOW, max_position_embeddings=64)
    config._attn_implementation = "eager"  # what transformers runs for Gemma2's softcapping
    model = transformers.Gemma2ForCausalLM(config).eval()
    assert config.layer_types == ["sliding_attention", "full_attention"]
    with torch.no_grad():  # random q/k weights give scores far below the cap of 50: scale them
        for layer in model.model.layers:  # up so that the cap changes the logits by ~5%
            layer.self_attn.q_proj.weight.mul_(60.0)
            layer.self_attn.k_proj.weight.mul_(60.0)
    return Logits(model)


@pytest.fixture(scope="module")
def ids():
    # 8 tokens against a 4-token window: the sliding layer's mask differs from the causal one.
    return torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def compiled(gemma2, ids):
    """(logits, the one report, the exported ONNX models) of one onnxruntime-target compile."""
    seen, real = [], export_module.export_graph

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    export_module.export_graph = spy
    try:
        torch._dynamo.reset()
        graphopt.reset()
        model = torch.compile(gemma2, backend="graphopt",
                              options={"target": "onnxruntime", "provider": "cpu", "fallback": "error"})
        with torch.no_grad():
            out = model(ids)
    finally:
        export_module.export_graph = real
    (report,) = graphopt.reports()
    return out, report, seen


def test_one_fused_op_per_norm_mlp_and_attention(compiled):
    _, report, _ = compiled
    counts = report.op_counts
    # 4 norms per layer (input, post-attention, pre- and post-feedforward) + the final norm;
    # the residual adds before the pre-feedforward norm and the next layer's input norm fold in.
    assert count(counts, "graphopt.rms_norm") + count(counts, "graphopt.add_rms_norm") == 4 * LAYERS + 1, counts
    assert count(counts, "graphopt.geglu") + count(counts, "graphopt.swiglu") == LAYERS, counts
    assert count(counts, "graphopt.attention") == LAYERS, counts
    for gone in ("aten.rsqrt", "aten._softmax", "aten.bmm"):
        assert count(counts, gone) == 0, counts
    # The only tanh left is the final logit cap (graphopt fuses no final cap, and needs none).
    assert count(counts, "aten.tanh") == 1, counts
    assert [m for m in report.near_misses if m.pass_name == "fuse_attention"] == []
    assert not report.fallbacks, report.fallbacks


def test_attention_reaches_group_query_attention_with_softcap(compiled):
    _, _, seen = compiled
    (model,) = seen
    fused = model.fused_op_counts()
    assert fused.get(GQA) == LAYERS, fused
    assert "com.microsoft::MultiHeadAttention" not in fused  # it has no softcap: never chosen for a cap
    gqa = [n for n in model.model.graph if n.op_type == "GroupQueryAttention"]
    assert [n.attributes["softcap"].value for n in gqa] == [ATTN_CAP] * LAYERS
    # Each layer's mask (the sliding window's and the causal one) is GQA's attention_bias
    # (input 10), so the window needs no local_window_size.
    assert all(len(n.inputs) > 10 and n.inputs[10] is not None for n in gqa)
    assert all(n.attributes["local_window_size"].value == -1 for n in gqa if "local_window_size" in n.attributes)
    assert fused.get("SimplifiedLayerNormalization", 0) + fused.get(
        "com.microsoft::SkipSimplifiedLayerNormalization", 0) == 4 * LAYERS + 1, fused


def test_logits_match_eager(compiled, gemma2, ids):
    out, _, _ = compiled
    # fp32 throughout; ORT's kernels sum in another order: 1e-5 relative.
    assert_matches_eager(out, eager(gemma2, ids), rel=1e-5)


def test_the_window_and_the_cap_matter_on_this_input(gemma2, ids):
    # Guards the tests above against data on which a dropped window or cap changes nothing.
    model = gemma2.model
    base = eager(gemma2, ids)
    attns = [layer.self_attn for layer in model.model.layers]
    model.config.sliding_window = 64  # the mask builder reads the window from the config
    try:
        assert rel_err(eager(gemma2, ids), base) > 1e-3
    finally:
        model.config.sliding_window = WINDOW
    for attn in attns:
        attn.attn_logit_softcapping = None
    try:
        assert rel_err(eager(gemma2, ids), base) > 1e-2
    finally:
        for attn in attns:
            attn.attn_logit_softcapping = ATTN_CAP
    assert rel_err(eager(gemma2, ids), base) == 0.0
