"""fuse_attention: the spellings it must fuse, the near misses it must leave, numerics."""

import math
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
import transformers
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import graphopt
import graphopt.models
from graphopt import ir
from tests.helpers import aten_graph, assert_matches_eager, compile_with_graphopt, count, eager, run_pass

PIPE = ["canonicalize", "fuse_rope", "fuse_attention"]
B, H, S, D = 2, 4, 8, 16
aten = torch.ops.aten


def qkv(heads=H, kv_heads=H, sq=S, skv=S, dtype=torch.float32):
    torch.manual_seed(0)
    return (torch.randn(B, heads, sq, D, dtype=dtype), torch.randn(B, kv_heads, skv, D, dtype=dtype),
            torch.randn(B, kv_heads, skv, D, dtype=dtype))


def padding_mask(skv=S):
    keep = torch.ones(B, 1, 1, skv, dtype=torch.bool)
    keep[1, ..., skv - 3:] = False
    return torch.zeros(B, 1, 1, skv).masked_fill(~keep, float("-inf"))


def repeat_kv(x, groups):
    """transformers' repeat_kv."""
    b, kv, s, d = x.shape
    return x[:, :, None, :, :].expand(b, kv, groups, s, d).reshape(b, kv * groups, s, d)


class Sdpa(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs = kwargs

    def forward(self, q, k, v, *mask):
        return F.scaled_dot_product_attention(q, k, v, *mask, **self.kwargs)


class SdpaRepeatKv(nn.Module):
    """transformers' sdpa_attention_forward for GQA: repeat_kv, then SDPA."""

    def forward(self, q, k, v, mask):
        groups = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask)


class BertEager(nn.Module):
    """Older BERTs: matmul, divide by sqrt(d), additive mask, softmax, dropout, matmul."""

    def __init__(self):
        super().__init__()
        self.dropout = nn.Dropout(0.1)

    def forward(self, q, k, v, mask):
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        probs = self.dropout(nn.functional.softmax(scores + mask, dim=-1))
        return torch.matmul(probs, v)


class LlamaEager(nn.Module):
    """transformers' eager_attention_forward: repeat_kv, * scaling, softmax in float32."""

    def forward(self, q, k, v, mask):
        groups = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        scores = torch.matmul(q, k.transpose(2, 3)) * (q.shape[-1] ** -0.5)
        probs = nn.functional.softmax(scores + mask, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)


class UnscaledNoMask(nn.Module):
    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v


def _check(module, inputs, rel=1e-5):
    out, report = compile_with_graphopt(module, *inputs, passes=PIPE)
    assert count(report, "graphopt.attention") == 1, report.op_counts
    for gone in ("aten._scaled_dot_product_flash_attention_for_cpu", "aten._softmax", "aten.bmm"):
        assert count(report, gone) == 0, report.op_counts
    assert_matches_eager(out, eager(module, *inputs), rel=rel)
    return report


@pytest.mark.parametrize(
    "module, inputs",
    [
        (Sdpa(), qkv() + (padding_mask(),)),
        (Sdpa(), qkv() + (torch.rand(B, 1, S, S) > 0.3,)),
        (Sdpa(is_causal=True), qkv()),
        (Sdpa(scale=0.3), qkv()),
        (Sdpa(enable_gqa=True, is_causal=True), qkv(kv_heads=2)),
    ],
    ids=["additive_mask", "bool_mask", "causal", "scale", "enable_gqa"],
)
def test_sdpa_cpu_spelling(module, inputs):
    _check(module, inputs)


def test_repeat_kv_is_looked_through():
    report = _check(SdpaRepeatKv(), qkv(kv_heads=2) + (padding_mask(),))
    # k/v reach the op with their 2 heads: the expand + clone that copied them died.
    assert count(report, "aten.expand") == 0 and count(report, "aten.clone") == 0, report.op_counts


@pytest.mark.parametrize(
    "module, inputs",
    [
        (BertEager().eval(), qkv() + (padding_mask(),)),
        (LlamaEager(), qkv(kv_heads=2) + (padding_mask(),)),
        (UnscaledNoMask(), qkv()),
    ],
    ids=["bert_div", "llama_repeat_kv", "no_scale_no_mask"],
)
def test_explicit_spelling(module, inputs):
    report = _check(module, inputs)
    assert count(report, "aten.expand") == 0, report.op_counts


def test_export_path_sdpa_and_explicit():
    for module, inputs in ((Sdpa(), qkv() + (padding_mask(),)), (LlamaEager(), qkv(kv_heads=2) + (padding_mask(),))):
        gm = aten_graph(module.eval(), *inputs)
        result = run_pass("fuse_attention", gm)
        assert result.stats["matches"] == 1, ir.format_graph(result.gm)
        assert ir.op_counts(result.gm).get("graphopt.attention") == 1
        with torch.no_grad():
            assert_matches_eager(result.gm(*inputs), eager(module, *inputs), rel=1e-5)


def test_fp16_matches_eager():
    # fp16 inputs: the op scores and normalises in float32 and rounds once at the end, eager rounds
    # the scores and the probabilities to fp16 too, so allow 2e-3 relative.
    for module in (Sdpa(), LlamaEager()):
        inputs = qkv(kv_heads=2 if isinstance(module, LlamaEager) else H, dtype=torch.float16) \
            + (padding_mask().half(),)
        out, report = compile_with_graphopt(module, *inputs, passes=PIPE)
        assert count(report, "graphopt.attention") == 1, report.op_counts
        assert out.dtype == torch.float16
        assert_matches_eager(out, eager(module, *inputs), rel=2e-3)


def test_dynamic_batch_and_sequence():
    torch._dynamo.reset()
    graphopt.reset()
    module = SdpaRepeatKv()
    compiled = torch.compile(module, backend="graphopt", options={"target": "eager", "fallback": "error",
                                                                  "pipeline": PIPE})
    for seq in (8, 5):
        inputs = qkv(kv_heads=2, sq=seq, skv=seq) + (padding_mask(seq),)
        for t in inputs:
            torch._dynamo.mark_dynamic(t, t.dim() - 1 if t is inputs[3] else 2)
        with torch.no_grad():
            assert_matches_eager(compiled(*inputs), eager(module, *inputs), rel=1e-5)
    assert len(graphopt.reports()) == 1
    assert count(graphopt.reports()[0], "graphopt.attention") == 1


# ---------------------------------------------------------------- hand-built graphs (CUDA SDPA ops)

def _sdpa_graph(op, *, mask=False, dropout=0.0, causal=False, read=(0,), sq=S, device="cuda"):
    """An aot-style graph calling one of ATen's SDPA ops on fake tensors of ``device``: the CUDA
    variants can't run here, but their graphs can be matched and, once rewritten, run."""
    mode = FakeTensorMode()
    graph = fx.Graph()
    names = [("q", (B, H, sq, D)), ("k", (B, H, S, D)), ("v", (B, H, S, D))]
    names += [("mask", (B, 1, sq, S))] if mask else []
    nodes = []
    for name, shape in names:
        node = graph.placeholder(name)
        with mode:
            node.meta["val"] = torch.empty(shape, device=device)
        nodes.append(node)
    q, k, v = nodes[:3]
    bias = nodes[3] if mask else None
    if op is aten._scaled_dot_product_flash_attention_for_cpu.default:
        call = graph.call_function(op, (q, k, v, dropout, causal), {"attn_mask": bias, "scale": 0.3})
    elif op is aten._scaled_dot_product_flash_attention.default:
        call = graph.call_function(op, (q, k, v, dropout, causal, False), {"scale": 0.3})
    else:  # efficient / cudnn: (q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal, ...)
        call = graph.call_function(op, (q, k, v, bias, False, dropout, causal), {"scale": 0.3})
    ir.infer_val(call, mode)
    outs = []
    for i in read:
        item = graph.call_function(operator.getitem, (call, i))
        item.meta["val"] = call.meta["val"][i]
        outs.append(item)
    graph.output(tuple(outs))
    return fx.GraphModule(nn.Module(), graph)


CUDA_OPS = [aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_cudnn_attention.default]


@pytest.mark.parametrize("op", CUDA_OPS, ids=lambda op: op.__name__)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cuda_sdpa_ops_match_on_hand_built_graphs(op, causal):
    with_mask = op is not aten._scaled_dot_product_flash_attention.default and not causal
    gm = _sdpa_graph(op, mask=with_mask, causal=causal)
    result = run_pass("fuse_attention", gm)
    assert result.stats["matches"] == 1, [m.reason for m in result.near_misses]
    assert ir.op_counts(result.gm).get("graphopt.attention") == 1
    assert op.__name__ not in str(result.gm.graph)  # the op is gone, not merely unread
    inputs = qkv() + ((padding_mask().expand(B, 1, S, S).contiguous(),) if with_mask else ())
    (out,) = result.gm(*inputs)
    want = F.scaled_dot_product_attention(*inputs[:3], attn_mask=inputs[3] if with_mask else None,
                                          is_causal=causal, scale=0.3)
    assert_matches_eager(out, want, rel=1e-5)


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        ({"dropout": 0.1}, "dropout_p 0.1, expected 0"),
        ({"read": (0, 1)}, "output 1 of aten._scaled_dot_product_flash_attention_for_cpu is read"),
        ({"causal": True, "sq": 4}, "is_causal with Sq 4 != Skv 8"),
    ],
    ids=["dropout", "logsumexp_read", "causal_sq_ne_skv"],
)
def test_skips_sdpa_ops(kwargs, reason):
    gm = _sdpa_graph(aten._scaled_dot_product_flash_attention_for_cpu.default, device="cpu", **kwargs)
    result = run_pass("fuse_attention", gm)
    assert result.stats["matches"] == 0
    reasons = [m.reason for m in result.near_misses]
    assert any(reason in r for r in reasons), reasons


# ---------------------------------------------------------------- near misses (explicit form)

class SoftmaxOverQueries(nn.Module):
    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.25, dim=-2) @ v


class ScaleFromInput(nn.Module):
    def forward(self, q, k, v, scale):
        return torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1) @ v


class ReturnsProbs(nn.Module):
    """output_attentions=True: the probabilities are a second result."""

    def forward(self, q, k, v):
        probs = torch.softmax(q @ k.transpose(-1, -2) * 0.25, dim=-1)
        return probs @ v, probs


class KeyNotTransposed(nn.Module):
    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(1, 3) * 0.25, dim=-1) @ v


class MaskBroadcastsUp(nn.Module):
    def forward(self, q, k, v, mask):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.25 + mask, dim=-1) @ v


@pytest.mark.parametrize(
    "module, inputs, reason",
    [
        (SoftmaxOverQueries(), qkv(), "softmax over dim -2, expected -1"),
        (ScaleFromInput(), qkv() + (torch.tensor([0.25]),), "scale is not a constant"),
        (ReturnsProbs(), qkv(), "attention probs"),
        (KeyNotTransposed(), (torch.randn(B, H, S, D), torch.randn(B, S, D, H), torch.randn(B, H, S, D)),
         "k is not transposed on the last two dims"),
        (MaskBroadcastsUp(), (torch.randn(1, H, S, D), torch.randn(1, H, S, D), torch.randn(3, H, S, D),
                              torch.zeros(3, 1, S, S)), "broadcasts the scores [1, 4, 8, 8] up to [3, 4, 8, 8]"),
    ],
    ids=["softmax_axis", "scale_not_constant", "probs_second_user", "k_not_transposed", "mask_too_big"],
)
def test_skips_when_math_differs(module, inputs, reason):
    out, report = compile_with_graphopt(module, *inputs, passes=PIPE)
    assert count(report, "graphopt.attention") == 0
    reasons = [m.reason for m in report.near_misses if m.pass_name == "fuse_attention"]
    assert any(reason in r for r in reasons), reasons
    assert_matches_eager(out, eager(module, *inputs), rel=1e-6)


def test_skips_dropout_in_training_mode():
    out, report = compile_with_graphopt(BertEager().train(), *qkv(), padding_mask(), passes=PIPE)
    assert count(report, "graphopt.attention") == 0
    assert any("dropout p=0.1 on the attention probs (training mode)" in m.reason for m in report.near_misses)


def test_skips_top_left_causal_with_more_keys():
    inputs = qkv(sq=4)
    out, report = compile_with_graphopt(Sdpa(is_causal=True), *inputs, passes=PIPE)
    assert count(report, "graphopt.attention") == 0
    assert any("is_causal with Sq 4 != Skv 8" in m.reason for m in report.near_misses), report.near_misses
    assert_matches_eager(out, eager(Sdpa(is_causal=True), *inputs), rel=1e-6)


# ---------------------------------------------------------------- real models

class Logits(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids, use_cache=False).logits


class Hidden(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, attention_mask):
        return self.model(ids, attention_mask=attention_mask).last_hidden_state


def _llama(impl):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    config._attn_implementation = impl
    return Logits(transformers.LlamaForCausalLM(config).eval())


def _bert(impl):
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, vocab_size=128)
    config._attn_implementation = impl
    return Hidden(transformers.BertModel(config).eval())


IDS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
PADDED = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])


@pytest.mark.parametrize(
    "build, impl, inputs",
    [(_llama, "sdpa", (IDS,)), (_llama, "eager", (IDS,)), (_bert, "sdpa", (IDS, PADDED)),
     (_bert, "eager", (IDS, PADDED))],
    ids=["llama_sdpa", "llama_eager", "bert_sdpa", "bert_eager"],
)
def test_transformers_models_one_attention_per_layer(build, impl, inputs):
    module = build(impl)
    out, report = compile_with_graphopt(module, *inputs, passes=["canonicalize", "fuse_rope", "fuse_attention"])
    assert count(report, "graphopt.attention") == 2, report.op_counts  # 2 layers
    assert count(report, "aten._softmax") == 0 and count(report, "aten.bmm") == 0
    assert [m for m in report.near_misses if m.pass_name == "fuse_attention"] == []
    if build is _llama:
        assert count(report, "graphopt.rope") == 4
        # repeat_kv's two clones per layer are gone (k/v reach the op with 2 heads); one layout
        # copy of the op's output per layer stays for the view that follows it.
        assert count(report, "aten.clone") == 2, report.op_counts
    assert_matches_eager(out, eager(module, *inputs), rel=1e-5)


@pytest.mark.parametrize("name", ["llama-tiny", "bert-tiny"])
def test_reference_models(name):
    model = graphopt.models.build(name)
    inputs = graphopt.models.example_inputs(name, batch=2, seq_len=8)

    class First(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *args):
            out = self.model(*args)
            return out[0] if isinstance(out, tuple) else out

    module = First()
    out, report = compile_with_graphopt(module, *inputs, passes=["canonicalize", "fuse_rope", "fuse_attention"])
    assert count(report, "graphopt.attention") == 2, report.op_counts
    assert_matches_eager(out, eager(module, *inputs), rel=1e-5)

