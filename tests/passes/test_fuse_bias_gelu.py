"""fuse_bias_gelu: the spellings it must fuse, the near misses it must leave, numerics."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import aten_graph, assert_matches_eager, compile_with_graphopt, count, eager, run_pass

PIPE = ["canonicalize", "fuse_bias_gelu"]
H, N = 32, 64


def new_gelu(x, coeff=0.044715, scale=math.sqrt(2.0 / math.pi)):
    """GPT-2's gelu_new / HF NewGELUActivation, written out."""
    return 0.5 * x * (1.0 + torch.tanh(scale * (x + coeff * torch.pow(x, 3.0))))


def fast_gelu(x):
    """HF FastGELUActivation: the same function, factored differently."""
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def erf_gelu(x, divisor=math.sqrt(2.0)):
    """HF GELUActivation(use_gelu_python=True)."""
    return x * 0.5 * (1.0 + torch.erf(x / divisor))


class LinearGelu(nn.Module):
    def __init__(self, approximate="none"):
        super().__init__()
        self.fc = nn.Linear(H, N)
        self.approximate = approximate

    def forward(self, x):
        return F.gelu(self.fc(x), approximate=self.approximate)


class BiasAddGelu(nn.Module):
    def __init__(self, bias_first=False):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(N))
        self.bias_first = bias_first

    def forward(self, x):
        return F.gelu(self.bias + x if self.bias_first else x + self.bias, approximate="tanh")


class PlainGelu(nn.Module):
    def forward(self, x):
        return F.gelu(x)


class HandWritten(nn.Module):
    def __init__(self, fn, bias=False):
        super().__init__()
        self.fn = fn
        self.bias = nn.Parameter(torch.randn(N)) if bias else None

    def forward(self, x):
        return self.fn(x if self.bias is None else x + self.bias)


class Gpt2Mlp(nn.Module):
    """GPT-2's MLP: Conv1D (addmm with the weight stored [in, out]) and gelu_new by hand."""

    def __init__(self):
        super().__init__()
        self.w_fc, self.b_fc = nn.Parameter(0.2 * torch.randn(H, N)), nn.Parameter(0.2 * torch.randn(N))
        self.w_proj, self.b_proj = nn.Parameter(0.2 * torch.randn(N, H)), nn.Parameter(0.2 * torch.randn(H))

    def forward(self, x):
        shape = x.shape[:-1]
        h = torch.addmm(self.b_fc, x.view(-1, H), self.w_fc).view(*shape, N)
        h = new_gelu(h)
        return torch.addmm(self.b_proj, h.view(-1, N), self.w_proj).view(*shape, H)


torch.manual_seed(0)
CASES = [
    (LinearGelu("none"), "none", True),
    (LinearGelu("tanh"), "tanh", True),
    (BiasAddGelu(), "tanh", True),
    (BiasAddGelu(bias_first=True), "tanh", True),
    (PlainGelu(), "none", False),
    (HandWritten(new_gelu), "tanh", False),
    (HandWritten(fast_gelu, bias=True), "tanh", True),
    (HandWritten(erf_gelu, bias=True), "none", True),
    (Gpt2Mlp(), "tanh", True),
]
IDS = ["linear_erf", "linear_tanh", "x_plus_b", "b_plus_x", "no_bias", "new_gelu", "fast_gelu_bias", "erf_by_hand",
       "gpt2_mlp"]


@pytest.mark.parametrize("module, approximate, has_bias", CASES, ids=IDS)
def test_fuses_each_spelling_and_matches_eager(module, approximate, has_bias):
    torch.manual_seed(0)
    x = torch.randn(2, 5, N if isinstance(module, (BiasAddGelu, PlainGelu, HandWritten)) else H)
    out, report = compile_with_graphopt(module, x, passes=PIPE)
    assert count(report, "graphopt.bias_gelu") == 1
    assert report.passes[-1].matches == 1
    for op in ("aten.gelu", "aten.tanh", "aten.erf", "aten.pow", "aten.add"):
        assert count(report, op) == 0, report.op_counts
    # the GEMM that fed the activation gave its bias away; a second GEMM (c_proj) keeps its own
    assert count(report, "aten.addmm") == (1 if isinstance(module, Gpt2Mlp) else 0)
    fused = [n for n in _export_and_fuse(module, x) if n.target is torch.ops.graphopt.bias_gelu.default]
    assert [(n.args[1] is not None, n.args[2]) for n in fused] == [(has_bias, approximate)]
    assert_matches_eager(out, eager(module, x), rel=1e-5)


def _export_and_fuse(module, x):
    """The fused graph's nodes via torch.export (the report carries counts, not the graph)."""
    gm = aten_graph(module, x)
    for name in PIPE:
        gm = run_pass(name, gm).gm
    return list(gm.graph.nodes)


def test_two_dim_linear_without_view():
    torch.manual_seed(0)
    module, x = LinearGelu(), torch.randn(6, H)
    out, report = compile_with_graphopt(module, x, passes=PIPE)
    assert report.op_counts == {"aten.mm": 1, "aten.t": 1, "graphopt.bias_gelu": 1}
    assert_matches_eager(out, eager(module, x), rel=1e-5)


def test_export_graph_linear_gives_its_bias_away():
    torch.manual_seed(0)
    module, x = LinearGelu("tanh"), torch.randn(2, 3, H)
    result = run_pass("fuse_bias_gelu", aten_graph(module, x))
    assert result.stats["matches"] == 1
    linear = next(n for n in result.gm.graph.nodes if n.target is torch.ops.aten.linear.default)
    assert len(linear.args) == 2  # no bias left in the GEMM
    assert_matches_eager(result.gm(x), eager(module, x), rel=1e-5)


def test_fp16_linear_gelu_matches_eager():
    torch.manual_seed(0)
    module = Gpt2Mlp().half()
    x = torch.randn(4, 8, H).half()
    out, report = compile_with_graphopt(module, x, passes=PIPE)
    assert count(report, "graphopt.bias_gelu") == 1
    assert out.dtype == torch.float16
    assert_matches_eager(out, eager(module, x), rel=2e-3)


# -- near misses ------------------------------------------------------------------------------


class MatrixBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(8, 64))

    def forward(self, x):
        return F.gelu(x + self.bias)


class ScaledAddmm(nn.Module):
    def __init__(self):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(H, N)), nn.Parameter(torch.randn(N))

    def forward(self, x):
        return F.gelu(torch.addmm(self.b, x, self.w, beta=0.5))


class LinearOutputReused(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(H, N)

    def forward(self, x):
        h = self.fc(x)
        return F.gelu(h), h


class BiasAddReused(nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(N))

    def forward(self, x):
        h = x + self.bias
        return F.gelu(h), h


class TanhReused(nn.Module):
    def forward(self, x):
        t = torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0)))
        return 0.5 * x * (1.0 + t), t


@pytest.mark.parametrize(
    "module, inputs, reason",
    [
        (MatrixBias(), (torch.randn(2, 8, 64),), "bias [8, 64] is not a per-channel vector"),
        (ScaledAddmm(), (torch.randn(4, H),), "addmm has beta=0.5, expected 1"),
        (HandWritten(lambda x: new_gelu(x, coeff=0.05)), (torch.randn(2, N),),
         "tanh coefficient 0.05, expected 0.044715"),
        (HandWritten(lambda x: new_gelu(x, scale=0.8)), (torch.randn(2, N),),
         "tanh scale 0.8, expected 0.797885 (sqrt(2/pi))"),
        (HandWritten(lambda x: erf_gelu(x, divisor=1.5)), (torch.randn(2, N),),
         "erf scale 0.666667, expected 0.707107 (1/sqrt(2))"),
        (LinearOutputReused(), (torch.randn(2, 3, H),), "is also read by output"),
        (BiasAddReused(), (torch.randn(2, 3, N),), "is also read by output"),
        (TanhReused(), (torch.randn(2, N),), "tanh tanh has 2 users, expected 1"),
    ],
    ids=["matrix_bias", "addmm_beta", "tanh_coeff", "tanh_scale", "erf_scale", "linear_reused", "bias_add_reused",
         "tanh_reused"],
)
def test_skips_when_math_differs(module, inputs, reason):
    out, report = compile_with_graphopt(module, *inputs, passes=PIPE)
    assert count(report, "graphopt.bias_gelu") == 0
    reasons = [m.reason for m in report.near_misses if m.pass_name == "fuse_bias_gelu"]
    assert any(reason in r for r in reasons), reasons
    assert_matches_eager(out, eager(module, *inputs), rel=1e-5)


# -- real models ------------------------------------------------------------------------------


def test_transformers_bert_every_gelu_takes_its_bias():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    layers = 2
    bert = BertModel(BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                num_attention_heads=4, vocab_size=128)).eval()

    class LastHidden(nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    module = LastHidden()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    _, before = compile_with_graphopt(module, ids, mask, passes=["canonicalize"])
    out, report = compile_with_graphopt(module, ids, mask, passes=PIPE)
    assert count(report, "graphopt.bias_gelu") == layers
    assert count(report, "aten.gelu") == 0
    assert count(report, "aten.addmm") == count(before, "aten.addmm") - layers
    assert count(report, "aten.mm") == count(before, "aten.mm") + layers
    assert_matches_eager(out, eager(module, ids, mask), rel=1e-5)


def test_transformers_gpt2_gelu_new_by_hand_fuses():
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    layers = 2
    gpt2 = GPT2Model(GPT2Config(n_embd=64, n_layer=layers, n_head=4, vocab_size=128, n_positions=32,
                                bos_token_id=0, eos_token_id=0)).eval()
    assert gpt2.config.activation_function == "gelu_new"

    class LastHidden(nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt2 = gpt2

        def forward(self, ids):
            return self.gpt2(input_ids=ids, use_cache=False).last_hidden_state

    module, ids = LastHidden(), torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    out, report = compile_with_graphopt(module, ids, passes=PIPE)
    assert count(report, "graphopt.bias_gelu") == layers
    assert count(report, "aten.tanh") == 0 and count(report, "aten.pow") == 0
    assert_matches_eager(out, eager(module, ids), rel=1e-5)
