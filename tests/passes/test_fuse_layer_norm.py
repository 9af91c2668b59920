"""fuse_layer_norm: the spellings it must fuse, the near misses it must leave, numerics."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import aten_graph, assert_matches_eager, compile_with_graphopt, count, eager, run_pass

PIPE = ["canonicalize", "fuse_rms_norm", "fuse_layer_norm"]
H = 32


def affine(module: nn.Module) -> nn.Module:
    """Non-trivial weight and bias, so a dropped one shows up as a mismatch."""
    module.w = nn.Parameter(1 + 0.1 * torch.randn(H))
    module.b = nn.Parameter(0.1 * torch.randn(H))
    return module


class NativeLayerNorm(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.ln = nn.LayerNorm(H, eps=1e-6, **kwargs)
        if self.ln.weight is not None:
            nn.init.normal_(self.ln.weight, 1.0, 0.1)
        if self.ln.bias is not None:
            nn.init.normal_(self.ln.bias, 0.0, 0.1)

    def forward(self, x):
        return self.ln(x)


class FunctionalLayerNorm(nn.Module):
    def __init__(self):
        super().__init__()
        affine(self)

    def forward(self, x):
        return F.layer_norm(x, (H,), self.w, self.b, 1e-5)


class VarSqrtDiv(nn.Module):
    """``(x - mean) / sqrt(var(unbiased=False) + eps) * w + b``."""

    def __init__(self):
        super().__init__()
        affine(self)

    def forward(self, x):
        var = x.var(-1, unbiased=False, keepdim=True)
        return (x - x.mean(-1, keepdim=True)) / torch.sqrt(var + 1e-5) * self.w + self.b


class MeanSquaredRsqrt(nn.Module):
    """The original BertLayerNorm spelling: the deviation written twice, w on the left."""

    def __init__(self):
        super().__init__()
        affine(self)

    def forward(self, x):
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        return self.w * ((x - u) * torch.rsqrt(s + 1e-5)) + self.b


class DeviationOnceRsqrt(nn.Module):
    """The deviation computed once: fuse_rms_norm sees rms_norm(x - mean) and runs first."""

    def __init__(self):
        super().__init__()
        affine(self)

    def forward(self, x):
        d = x - x.mean(-1, keepdim=True)
        return d * torch.rsqrt((d * d).mean(-1, keepdim=True) + 1e-5) * self.w + self.b


class VarMeanNoAffine(nn.Module):
    def forward(self, x):
        var, mean = torch.var_mean(x, -1, correction=0, keepdim=True)
        return (x - mean) / torch.sqrt(var + 1e-5)


torch.manual_seed(0)
SPELLINGS = [NativeLayerNorm(), NativeLayerNorm(elementwise_affine=False), NativeLayerNorm(bias=False),
             FunctionalLayerNorm(), VarSqrtDiv(), MeanSquaredRsqrt(), DeviationOnceRsqrt(), VarMeanNoAffine()]
IDS = ["native", "native_no_affine", "native_no_bias", "functional", "var_sqrt_div", "mean_sq_rsqrt",
       "rms_of_deviation", "var_mean"]


@pytest.mark.parametrize("module", SPELLINGS, ids=IDS)
def test_fuses_each_spelling_and_matches_eager(module):
    torch.manual_seed(0)
    x = torch.randn(2, 5, H)
    out, report = compile_with_graphopt(module, x, passes=PIPE)
    assert count(report, "graphopt.layer_norm") == 1
    assert count(report, "graphopt.rms_norm") == 0
    leftovers = {"aten.native_layer_norm", "aten.mean", "aten.var", "aten.var_mean", "aten.sqrt", "aten.rsqrt",
                 "aten.mul", "aten.add", "aten.sub", "aten.div"}
    assert not leftovers & set(report.op_counts), report.op_counts
    assert report.passes[-1].matches == 1
    assert_matches_eager(out, eager(module, x), rel=1e-5)


@pytest.mark.parametrize("order", [["fuse_layer_norm", "fuse_rms_norm"], ["fuse_rms_norm", "fuse_layer_norm"]])
def test_decomposed_rsqrt_fuses_whichever_norm_pass_runs_first(order):
    torch.manual_seed(0)
    module, x = DeviationOnceRsqrt(), torch.randn(3, H)
    out, report = compile_with_graphopt(module, x, passes=["canonicalize", *order])
    assert report.op_counts == {"graphopt.layer_norm": 1}
    matches = {p.name: p.matches for p in report.passes}
    # run first, fuse_rms_norm takes rms_norm(x - mean(x)); fuse_layer_norm then rewrites that
    assert matches == {"canonicalize": 0, "fuse_rms_norm": int(order[0] == "fuse_rms_norm"), "fuse_layer_norm": 1}
    assert_matches_eager(out, eager(module, x), rel=1e-5)


class ResidualSumReused(nn.Module):
    """Pre-norm block: ``h = x + attn; ln(h)`` and h stays the residual stream."""

    def __init__(self):
        super().__init__()
        self.ln = NativeLayerNorm()

    def forward(self, x, y):
        h = x + y
        return self.ln(h) * 2.0, h + 1.0


def test_residual_add_becomes_add_layer_norm_and_sum_users_read_second_output():
    torch.manual_seed(0)
    module, x, y = ResidualSumReused(), torch.randn(2, 4, H), torch.randn(2, 4, H)
    out, report = compile_with_graphopt(module, x, y, passes=PIPE)
    assert count(report, "graphopt.add_layer_norm") == 1
    assert count(report, "graphopt.layer_norm") == 0
    assert count(report, "aten.add") == 1  # only h + 1.0 is left, reading the fused sum
    assert_matches_eager(out, eager(module, x, y), rel=1e-5)


class DecomposedResidual(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = VarSqrtDiv()

    def forward(self, x, y):
        h = x + y
        return self.norm(h), h


def test_decomposed_residual_add_becomes_add_layer_norm():
    torch.manual_seed(0)
    module, x, y = DecomposedResidual(), torch.randn(2, 4, H), torch.randn(2, 4, H)
    out, report = compile_with_graphopt(module, x, y, passes=PIPE)
    assert report.op_counts == {"graphopt.add_layer_norm": 1}
    assert_matches_eager(out, eager(module, x, y), rel=1e-5)


def test_fp16_residual_layer_norm_matches_eager():
    torch.manual_seed(0)
    module = ResidualSumReused().half()
    x, y = torch.randn(4, 8, H).half(), torch.randn(4, 8, H).half()
    out, report = compile_with_graphopt(module, x, y, passes=PIPE)
    assert count(report, "graphopt.add_layer_norm") == 1
    assert out[0].dtype == torch.float16
    assert_matches_eager(out, eager(module, x, y), rel=2e-3)


def test_export_graph_layer_norm_fuses():
    torch.manual_seed(0)
    module, x = NativeLayerNorm(), torch.randn(2, 3, H)
    gm = aten_graph(module, x)
    result = run_pass("fuse_layer_norm", gm)
    assert result.stats["matches"] == 1
    assert_matches_eager(result.gm(x), eager(module, x), rel=1e-5)


# -- near misses ------------------------------------------------------------------------------


class TwoDims(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm([8, 64])

    def forward(self, x):
        return self.ln(x)


class StatsUsed(nn.Module):
    def __init__(self):
        super().__init__()
        affine(self)

    def forward(self, x):
        out, mean, _ = torch.native_layer_norm(x, [H], self.w, self.b, 1e-5)
        return out, mean


class Unbiased(nn.Module):
    def forward(self, x):
        return (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, keepdim=True) + 1e-5)


class OtherAxis(nn.Module):
    def forward(self, x):
        var = x.var(1, unbiased=False, keepdim=True)
        return (x - x.mean(1, keepdim=True)) / torch.sqrt(var + 1e-5)


class EpsFromInput(nn.Module):
    def forward(self, x, eps):
        return (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + eps)


class MeanReused(nn.Module):
    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5), mean


class OtherTensorNormalised(nn.Module):
    def forward(self, x, y):
        return (y - y.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5)


@pytest.mark.parametrize(
    "module, inputs, reason",
    [
        (TwoDims(), (torch.randn(2, 8, 64),), "normalized over 2 dims [8, 64], expected the last"),
        (StatsUsed(), (torch.randn(2, 3, H),), "mean/rstd outputs (getitem 1) are used"),
        (Unbiased(), (torch.randn(2, 3, H),), "variance correction 1 (unbiased), expected 0"),
        (OtherAxis(), (torch.randn(2, 4, 8),), "variance over dim 1, expected -1"),
        (EpsFromInput(), (torch.randn(2, H), torch.full((2, 1), 1e-5)), "eps is not a constant"),
        (MeanReused(), (torch.randn(2, H),), "outside the layer norm"),
        (OtherTensorNormalised(), (torch.randn(2, H), torch.randn(2, H)), "normalises a different tensor"),
    ],
    ids=["two_dims", "stats_used", "unbiased", "other_axis", "eps_not_constant", "second_user", "other_tensor"],
)
def test_skips_when_math_differs(module, inputs, reason):
    out, report = compile_with_graphopt(module, *inputs, passes=PIPE)
    assert count(report, "graphopt.layer_norm") == 0 and count(report, "graphopt.add_layer_norm") == 0
    reasons = [m.reason for m in report.near_misses if m.pass_name == "fuse_layer_norm"]
    assert any(reason in r for r in reasons), reasons
    assert_matches_eager(out, eager(module, *inputs), rel=1e-5)


class BroadcastResidual(nn.Module):
    """BERT's embeddings: a [1, S, H] position table added to [B, S, H]."""

    def __init__(self):
        super().__init__()
        self.ln = NativeLayerNorm()

    def forward(self, x, pos):
        return self.ln(x + pos)


class AlphaResidual(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = NativeLayerNorm()

    def forward(self, x, y):
        return self.ln(torch.add(x, y, alpha=2))


@pytest.mark.parametrize(
    "module, inputs, reason",
    [
        (BroadcastResidual(), (torch.randn(2, 4, H), torch.randn(1, 4, H)),
         f"residual add broadcasts [1, 4, {H}] to [2, 4, {H}]; fused without the add"),
        (AlphaResidual(), (torch.randn(2, 4, H), torch.randn(2, 4, H)), "add with alpha 2; fused without the add"),
    ],
    ids=["broadcast", "alpha"],
)
def test_skips_residual_add_that_is_not_a_plain_skip(module, inputs, reason):
    out, report = compile_with_graphopt(module, *inputs, passes=PIPE)
    assert count(report, "graphopt.layer_norm") == 1
    assert count(report, "graphopt.add_layer_norm") == 0
    reasons = [m.reason for m in report.near_misses if m.pass_name == "fuse_layer_norm"]
    assert reasons == [reason]
    assert_matches_eager(out, eager(module, *inputs), rel=1e-5)


def test_the_shared_pass_keeps_no_state_between_runs():
    """Passes are module-level singletons: a left-out add of one graph must not be reported
    for the next, and nothing of a run stays on the instance."""
    from graphopt.registry import get_pass

    first = run_pass("fuse_layer_norm", aten_graph(BroadcastResidual(), torch.randn(2, 4, H), torch.randn(1, 4, H)))
    assert [m.reason for m in first.near_misses] == [
        f"residual add broadcasts [1, 4, {H}] to [2, 4, {H}]; fused without the add"]
    second = run_pass("fuse_layer_norm", aten_graph(AlphaResidual(), torch.randn(2, 4, H), torch.randn(2, 4, H)))
    assert [m.reason for m in second.near_misses] == ["add with alpha 2; fused without the add"]
    assert vars(get_pass("fuse_layer_norm")) == {}


def test_real_rms_norms_are_screened_out():
    class Rms(nn.Module):
        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    gm = aten_graph(Rms(), torch.randn(2, H))
    run_pass("fuse_rms_norm", gm)
    result = run_pass("fuse_layer_norm", gm)
    assert [(m.reason, m.screened) for m in result.near_misses] == [
        ("rms_norm of a value that is not x - mean(x): an RMSNorm, not a LayerNorm", True)]


class WeightNotPerChannel(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(3, H))

    def forward(self, x):
        var = x.var(-1, unbiased=False, keepdim=True)
        return (x - x.mean(-1, keepdim=True)) / torch.sqrt(var + 1e-5) * self.scale


def test_scale_that_is_not_h_stays_outside_the_fused_op():
    torch.manual_seed(0)
    module, x = WeightNotPerChannel(), torch.randn(2, 3, H)
    out, report = compile_with_graphopt(module, x, passes=PIPE)
    assert report.op_counts == {"graphopt.layer_norm": 1, "aten.mul": 1}
    assert_matches_eager(out, eager(module, x), rel=1e-5)


# -- real models ------------------------------------------------------------------------------


class BertLastHidden(nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        from transformers import BertConfig, BertModel

        torch.manual_seed(0)
        config = BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                            vocab_size=128)
        self.bert = BertModel(config).eval()
        for module in self.bert.modules():  # non-trivial LayerNorm parameters
            if isinstance(module, nn.LayerNorm):
                nn.init.normal_(module.weight, 1.0, 0.1)
                nn.init.normal_(module.bias, 0.0, 0.1)

    def forward(self, input_ids, attention_mask):
        return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def test_transformers_bert_every_layer_norm_fuses():
    layers = 2
    module = BertLastHidden(layers)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    out, report = compile_with_graphopt(module, ids, mask, passes=PIPE)
    # post-norm layers: residual add + LayerNorm twice per layer; the embedding sum broadcasts
    # its [1, S, H] position table, so that LayerNorm fuses without the add
    assert count(report, "graphopt.add_layer_norm") == 2 * layers
    assert count(report, "graphopt.layer_norm") == 1
    assert count(report, "aten.native_layer_norm") == 0
    reasons = [m.reason for m in report.near_misses if m.pass_name == "fuse_layer_norm"]
    assert reasons == ["residual add broadcasts [1, 8, 64] to [2, 8, 64]; fused without the add"]
    assert_matches_eager(out, eager(module, ids, mask), rel=1e-5)


def test_transformers_gpt2_pre_norm_residual_stream():
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    layers = 2
    gpt2 = GPT2Model(GPT2Config(n_embd=64, n_layer=layers, n_head=4, vocab_size=128, n_positions=32,
                                bos_token_id=0, eos_token_id=0)).eval()

    class LastHidden(nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt2 = gpt2

        def forward(self, ids):
            return self.gpt2(input_ids=ids, use_cache=False).last_hidden_state

    module, ids = LastHidden(), torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    out, report = compile_with_graphopt(module, ids, passes=PIPE)
    # ln_1 of layer 0 reads the embeddings; every later LayerNorm reads a residual sum that the
    # stream reads again (ln_2, ln_1 of the next layer, ln_f)
    assert count(report, "graphopt.add_layer_norm") == 2 * layers
    assert count(report, "graphopt.layer_norm") == 1
    assert_matches_eager(out, eager(module, ids), rel=1e-5)
