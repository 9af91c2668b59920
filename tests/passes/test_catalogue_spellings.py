"""The catalogue's spellings end to end: a model fuses the same however its norms and MLPs
are written, and transformers' Phi3 (merged gate_up_proj and qkv_proj) fuses fully on the
onnxruntime target."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import assert_matches_eager, compile_with_graphopt, eager
from tests.passes.test_fuse_gated_mlp import CUTS, GATE_ACTS
from tests.passes.test_fuse_rms_norm import RMS_SPELLINGS

HIDDEN, HEADS, KV_HEADS, INTER, VOCAB, LAYERS = 32, 4, 2, 64, 64, 2
HEAD_DIM = HIDDEN // HEADS


class Norm(nn.Module):
    def __init__(self, spelling="rsqrt", upcast=True, weight_first=True):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(HIDDEN))
        self.spelling, self.upcast, self.weight_first = spelling, upcast, weight_first

    def forward(self, x):
        h = x.float() if self.upcast else x
        h = RMS_SPELLINGS[self.spelling](h, h.pow(2).mean(-1, keepdim=True) + 1e-6)
        h = h.to(x.dtype) if self.upcast else h
        return self.weight * h if self.weight_first else h * self.weight


class Mlp(nn.Module):
    """``merged=None``: Llama's gate_proj and up_proj; else gate_up_proj cut by ``CUTS[merged]``."""

    def __init__(self, act="silu", merged=None, up_first=False, gate_first=True):
        super().__init__()
        if merged is None:
            self.gate_proj = nn.Linear(HIDDEN, INTER, bias=False)
            self.up_proj = nn.Linear(HIDDEN, INTER, bias=False)
        else:
            self.gate_up_proj = nn.Linear(HIDDEN, 2 * INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=False)
        self.act, self.merged, self.up_first, self.gate_first = act, merged, up_first, gate_first

    def forward(self, x):
        if self.merged is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            first, second = CUTS[self.merged](self.gate_up_proj(x), INTER)
            gate, up = (first, second) if self.gate_first else (second, first)
        act = GATE_ACTS[self.act](gate)
        return self.down_proj(up * act if self.up_first else act * up)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)

    def forward(self, x):
        def heads(t):
            return t.view(*t.shape[:-1], -1, HEAD_DIM).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(-2))


class SpelledLlama(nn.Module):
    """A pre-norm Llama (no rotary: that is fuse_rope's catalogue) whose every RMSNorm and
    MLP is written with the given spelling."""

    def __init__(self, norm=None, mlp=None):
        super().__init__()
        torch.manual_seed(0)
        norm, mlp = norm or {}, mlp or {}
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(nn.ModuleDict(dict(
            input_norm=Norm(**norm), attn=Attention(), post_norm=Norm(**norm), mlp=Mlp(**mlp)))
            for _ in range(LAYERS))
        self.norm = Norm(**norm)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = h + layer["attn"](layer["input_norm"](h))
            h = h + layer["mlp"](layer["post_norm"](h))
        return self.lm_head(self.norm(h))


IDS = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
# What the standard spelling (rsqrt, upcast, separate gate/up, silu) fuses to: every norm but
# the first reads a residual sum; one swiglu, qkv_proj and attention per layer.
STANDARD = {"graphopt.rms_norm": 1, "graphopt.add_rms_norm": 2 * LAYERS, "graphopt.swiglu": LAYERS,
            "graphopt.qkv_proj": LAYERS, "graphopt.attention": LAYERS}


def graphopt_ops(report) -> dict[str, int]:
    return {op: n for op, n in report.op_counts.items() if op.startswith("graphopt.")}


def fused(module):
    out, report = compile_with_graphopt(module, IDS)
    assert_matches_eager(out, eager(module, IDS), rel=1e-5)
    return graphopt_ops(report), report


def test_standard_llama_fuses_to_the_expected_ops():
    ops, report = fused(SpelledLlama())
    assert ops == STANDARD
    assert not any(op in report.op_counts for op in ("aten.rsqrt", "aten.silu", "aten.mean"))


NORMS = [dict(spelling=s, upcast=c, weight_first=w) for s in RMS_SPELLINGS for c, w in ((True, True), (False, False))]


@pytest.mark.parametrize("norm", NORMS, ids=lambda n: f"{n['spelling']}-{'upcast' if n['upcast'] else 'no_cast'}")
def test_each_rms_norm_spelling_fuses_like_the_standard_llama(norm):
    ops, report = fused(SpelledLlama(norm=norm))
    assert ops == STANDARD
    assert not [m for m in report.near_misses if m.pass_name == "fuse_rms_norm"]


MLPS = {
    "x_sigmoid": dict(act="x_sigmoid"),
    "sigmoid_x_up_first": dict(act="sigmoid_x", up_first=True),
    "merged_chunk_up_first": dict(merged="chunk", up_first=True),  # Phi3
    "merged_split_x_sigmoid": dict(merged="split", act="x_sigmoid"),
    "merged_slice": dict(merged="slice"),
    "merged_gate_second": dict(merged="chunk", gate_first=False),
}


@pytest.mark.parametrize("mlp", MLPS.values(), ids=MLPS.keys())
def test_each_swiglu_spelling_fuses_like_the_standard_llama(mlp):
    ops, report = fused(SpelledLlama(mlp=mlp))
    assert ops == STANDARD
    assert not [m for m in report.near_misses if m.pass_name == "fuse_gated_mlp"]


# -- transformers' Phi3 on the onnxruntime target ----------------------------------------------


class Logits(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids, use_cache=False).logits


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_transformers_phi3_fuses_fully_on_onnxruntime(impl, monkeypatch):
    pytest.importorskip("onnxruntime", reason="the onnxruntime target needs onnxruntime")
    import transformers

    import graphopt.backends.onnxruntime.lower.export as ort_export

    models, export_graph = [], ort_export.export_graph

    def keep(*args, **kwargs):  # the ONNX model the target runs
        models.append(export_graph(*args, **kwargs))
        return models[-1]

    monkeypatch.setattr(ort_export, "export_graph", keep)

    torch.manual_seed(0)
    config = transformers.Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = impl
    module = Logits(transformers.Phi3ForCausalLM(config).eval())
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    out, report = compile_with_graphopt(module, ids, target="onnxruntime")
    assert report.target == "onnxruntime" and report.fallbacks == []
    ops = graphopt_ops(report)
    # 2 norms per layer + the final one, each one op; gate_up_proj and qkv_proj read as they are
    assert ops["graphopt.rms_norm"] + ops["graphopt.add_rms_norm"] == 2 * 2 + 1
    assert ops["graphopt.swiglu"] == 2 and ops["graphopt.qkv_proj"] == 2 and ops["graphopt.attention"] == 2
    assert "aten.silu" not in report.op_counts and "aten.split" not in report.op_counts
    (model,) = models
    onnx_ops = model.op_histogram()
    # every norm reached ORT as its fused kernel
    assert onnx_ops.get("com.microsoft::SkipSimplifiedLayerNormalization") == ops["graphopt.add_rms_norm"]
    assert onnx_ops.get("SimplifiedLayerNormalization") == ops["graphopt.rms_norm"]
    assert_matches_eager(out, eager(module, ids), rel=1e-5)
