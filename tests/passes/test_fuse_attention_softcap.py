"""fuse_attention on soft-capped scores (``tanh(s / c) * c`` before the mask, Gemma2 / Grok):
the spellings it must fuse with their cap, the near misses it must leave, numerics; and the
pass's own contract (``requires``, screened anchors).

(Kept apart from test_fuse_attention.py, which is near the size limit.)"""

import pytest
import torch
from torch import nn

from graphopt.errors import GraphoptError
from graphopt.pipeline import build_pipeline
from tests.helpers import aten_graph, assert_matches_eager, compile_with_graphopt, count, eager, run_pass
from tests.passes.test_fuse_attention import PIPE, padding_mask, qkv, repeat_kv

CAP = 5.0  # small against the scores of randn q/k (|s| up to ~10), so the cap changes the result


def _attention_ops(gm):
    return [n for n in gm.graph.nodes if n.target is torch.ops.graphopt.attention.default]


class Gemma2Eager(nn.Module):
    """transformers' Gemma2 eager_attention_forward: * scaling, / cap, tanh, * cap, + mask."""

    def __init__(self, scaling=0.3, cap=CAP):
        super().__init__()
        self.scaling, self.cap = scaling, cap

    def forward(self, q, k, v, mask):
        groups = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        scores = torch.tanh(scores / self.cap) * self.cap
        probs = nn.functional.softmax(scores + mask, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)


class GrokStyle(nn.Module):
    """The cap in front (``c * tanh(s * (1/c))``), no mask, the scale as a division."""

    def forward(self, q, k, v):
        scores = (q @ k.transpose(-1, -2)) / 4.0
        return torch.softmax(CAP * torch.tanh(scores * (1.0 / CAP)), dim=-1) @ v


class CastsAroundTheCap(nn.Module):
    """Half-precision scores capped in float32 and cast back, mask added after the cast."""

    def forward(self, q, k, v, mask):
        scores = torch.matmul(q, k.transpose(-1, -2)) * 0.25
        capped = (torch.tanh(scores.float() / CAP) * CAP).to(q.dtype)
        return torch.softmax((capped + mask).float(), dim=-1).to(q.dtype) @ v


def _fused_softcaps(module, inputs, rel):
    out, report = compile_with_graphopt(module, *inputs, passes=PIPE)
    assert count(report, "graphopt.attention") == 1, report.op_counts
    assert count(report, "aten.tanh") == 0 and count(report, "aten._softmax") == 0, report.op_counts
    assert [m.reason for m in report.near_misses if m.pass_name == "fuse_attention"] == []
    assert_matches_eager(out, eager(module, *inputs), rel=rel)


@pytest.mark.parametrize(
    "module, inputs",
    [
        (Gemma2Eager(), qkv(kv_heads=2) + (padding_mask(),)),
        (GrokStyle(), qkv()),
    ],
    ids=["gemma2_gqa_mask", "cap_first_operand_no_mask"],
)
def test_softcapped_scores_fuse_and_match_eager(module, inputs):
    # fp32: the op caps in float32 as eager does; 1e-5 relative.
    _fused_softcaps(module, inputs, rel=1e-5)


def test_softcap_through_casts_fp16():
    # fp16: eager rounds the scores and the capped scores to fp16, the op keeps them in
    # float32 and rounds once at the end: 2e-3 relative, as for fp16 attention without a cap.
    inputs = qkv(dtype=torch.float16) + (padding_mask().half(),)
    _fused_softcaps(CastsAroundTheCap(), inputs, rel=2e-3)


def test_the_op_carries_cap_and_combined_scale():
    # The exported graph's attention: softcap is the cap, scale is the scale before the cap.
    gm = aten_graph(GrokStyle(), *qkv())
    result = run_pass("fuse_attention", gm)
    (node,) = _attention_ops(result.gm)
    q, k, v, mask, scale, is_causal, softcap = node.args
    assert mask is None and not is_causal
    assert softcap == CAP and scale == pytest.approx(0.25, rel=1e-12)


def test_negative_outer_constant_is_the_same_cap():
    # -c * tanh(-s / c) == c * tanh(s / c): the op gets cap |c| and the scale's sign folded in.
    class NegatedCap(nn.Module):
        def forward(self, q, k, v):
            return torch.softmax(-CAP * torch.tanh((q @ k.transpose(-1, -2)) * -0.25 / CAP), dim=-1) @ v

    inputs = qkv()
    _fused_softcaps(NegatedCap(), inputs, rel=1e-5)
    result = run_pass("fuse_attention", aten_graph(NegatedCap(), *inputs))
    (node,) = _attention_ops(result.gm)
    assert node.args[6] == CAP and node.args[4] == pytest.approx(0.25, rel=1e-12)


# ---------------------------------------------------------------- near misses

class CapFromInput(nn.Module):
    def forward(self, q, k, v, cap):
        return torch.softmax(torch.tanh(q @ k.transpose(-1, -2) * 0.25 / cap) * cap, dim=-1) @ v


class CapAfterTheMask(nn.Module):
    """tanh((s + mask) / c) * c: the cap also squashes the mask's -inf to -c, other math."""

    def forward(self, q, k, v, mask):
        scores = q @ k.transpose(-1, -2) * 0.25 + mask
        return torch.softmax(torch.tanh(scores / CAP) * CAP, dim=-1) @ v


class ReturnsCappedScores(nn.Module):
    def forward(self, q, k, v):
        capped = torch.tanh(q @ k.transpose(-1, -2) * 0.25 / CAP)
        return torch.softmax(capped * CAP, dim=-1) @ v, capped


@pytest.mark.parametrize(
    "module, inputs, reason",
    [
        (CapFromInput(), qkv() + (torch.tensor(CAP),), "softcap: tanh(scores) is multiplied by a non-constant"),
        (CapAfterTheMask(), qkv() + (padding_mask(),),
         "softcap: tanh's input is not the scaled q @ k^T (a cap after the mask add"),
        (ReturnsCappedScores(), qkv(), "tanh of the scores tanh has 2 users; a fusion would lose the others"),
    ],
    ids=["cap_not_constant", "cap_after_mask", "capped_scores_second_user"],
)
def test_skips_softcap(module, inputs, reason):
    out, report = compile_with_graphopt(module, *inputs, passes=PIPE)
    assert count(report, "graphopt.attention") == 0, report.op_counts
    reasons = [m.reason for m in report.near_misses if m.pass_name == "fuse_attention"]
    assert any(reason in r for r in reasons), reasons
    assert_matches_eager(out, eager(module, *inputs), rel=1e-6)


def test_skips_capped_tensor_that_is_no_scores():
    # A cap of precomputed scores (an input, not q @ k^T) is no attention to fuse.
    class CappedInput(nn.Module):
        def forward(self, scores, v, mask):
            return torch.softmax(torch.tanh(scores / CAP) * CAP + mask, dim=-1) @ v

    q, _, v = qkv()
    inputs = (q @ q.transpose(-1, -2), v, padding_mask())
    out, report = compile_with_graphopt(CappedInput(), *inputs, passes=PIPE)
    assert count(report, "graphopt.attention") == 0
    reasons = [m.reason for m in report.near_misses if m.pass_name == "fuse_attention"]
    assert any("neither operand of the mask add is the scaled q @ k^T" in r for r in reasons), reasons
    assert_matches_eager(out, eager(CappedInput(), *inputs), rel=1e-6)


# ---------------------------------------------------------------- the pass's contract

def test_requires_fuse_rope_before_it():
    with pytest.raises(GraphoptError, match="pass fuse_attention needs fuse_rope to run before it"):
        build_pipeline(["canonicalize", "fuse_attention"])
    assert [p.name for p in build_pipeline(PIPE)] == PIPE


def test_other_matmuls_are_screened_with_their_reason():
    # q @ k^T (a bmm) is no probs @ v: screened, with a reason --why can group, not dropped silently.
    gm = aten_graph(Gemma2Eager(), *qkv(kv_heads=2), padding_mask())
    result = run_pass("fuse_attention", gm)
    assert result.stats["matches"] == 1
    screened = [m for m in result.near_misses if m.screened]
    assert screened and {m.reason for m in screened} == {"its first operand is no softmax output (not probs @ v)"}
    assert not [m for m in result.near_misses if not m.screened]


# ---------------------------------------------------------------- passes after it keep the cap

def test_static_kv_cache_keeps_the_cap():
    # static_kv_cache rebuilds each graphopt.attention over its static cache: the cap must survive.
    from tests.passes.test_static_kv_cache import _attention_inputs, export_step

    class CappedCacheAttention(nn.Module):
        def forward(self, q, k_new, v_new, past):
            k, v = torch.cat([past[0], k_new], dim=-2), torch.cat([past[1], v_new], dim=-2)
            return torch.ops.graphopt.attention(q, k, v, None, 2.0, False, 1.0), k, v

    module = CappedCacheAttention()
    (q, k, v), past = _attention_inputs()
    result = run_pass("static_kv_cache", export_step(module, q, k, v, past=past), max_length=16)
    assert result.modified, result.near_misses
    (q, k, v), real_past = _attention_inputs(past_len=9)
    caches = [torch.full((1, 2, 16, 8), 50.0) for _ in range(2)]
    for c, p in zip(caches, real_past):
        c[:, :, :9] = p
    (got,) = result.gm(q, k, v, *caches, torch.tensor(9))
    expected = module(q, k, v, real_past)[0]
    uncapped = torch.ops.graphopt.attention(q, torch.cat([real_past[0], k], 2), torch.cat([real_past[1], v], 2),
                                            None, 2.0, False)
    assert (uncapped - expected).abs().max() > 1e-2  # the cap matters on this data
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
