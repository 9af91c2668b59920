"""fuse_rope: the spellings it must fuse, the near misses it must leave, numerics."""

import pytest
import torch
import transformers
from torch import nn

import graphopt

from tests.helpers import assert_matches_eager, compile_with_graphopt, count, eager

PIPE = ["canonicalize", "fuse_rope"]
B, H, S, D = 2, 4, 8, 16


def rotate_half(x):
    """transformers' rotate_half."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):
    """GPT-J's interleaved rotation."""
    x1, x2 = x[:, :, :, ::2], x[:, :, :, 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rotate_pairs_unbind(x):
    """The same rotation with the pairs taken by a reshape (rotary-embedding-torch)."""
    x1, x2 = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def tables(batch=B, seq=S, dim=D, interleaved=False):
    """cos/sin [B, S, dim] as a model computes them from positions."""
    freqs = torch.arange(seq)[:, None].float() * (10000.0 ** (-torch.arange(0, dim, 2).float() / dim))
    emb = freqs.repeat_interleave(2, -1) if interleaved else torch.cat((freqs, freqs), -1)
    return emb.cos().expand(batch, -1, -1).contiguous(), emb.sin().expand(batch, -1, -1).contiguous()


class RotateHalfQK(nn.Module):
    """transformers' apply_rotary_pos_emb: cos/sin [B, S, D] unsqueezed at dim 1, q and k."""

    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + rotate_half(q) * sin, (k * cos) + (rotate_half(k) * sin)


class Interleaved(nn.Module):
    def __init__(self, rotate=rotate_every_two):
        super().__init__()
        self.rotate = rotate

    def forward(self, x, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return x * cos + self.rotate(x) * sin


class PartialRotary(nn.Module):
    """GPT-NeoX / Phi: rotate the first R channels, pass the rest through."""

    def forward(self, x, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        r = cos.shape[-1]
        x_rot, x_pass = x[..., :r], x[..., r:]
        return torch.cat([x_rot * cos + rotate_half(x_rot) * sin, x_pass], dim=-1)


class SeqMajorGPTJ(nn.Module):
    """GPT-J: x [B, S, H, D], interleaved, partial, tables [B, S, R/2] repeated per pair."""

    def forward(self, x, sin, cos):
        r = 2 * sin.shape[-1]
        sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
        cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
        x_rot, x_pass = x[:, :, :, :r], x[:, :, :, r:]
        x_rot = (x_rot * cos) + (rotate_every_two(x_rot) * sin)
        return torch.cat([x_rot, x_pass], dim=-1).permute(0, 2, 1, 3)


class LlamaStyleTables(nn.Module):
    """cos/sin computed in the graph and scaled by attention_scaling = 1.0 (canonicalize drops it)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 10000.0 ** (-torch.arange(0, D, 2).float() / D), persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = (emb.cos() * 1.0).unsqueeze(1), (emb.sin() * 1.0).unsqueeze(1)
        return x * cos + rotate_half(x) * sin


class BroadcastTables(nn.Module):
    """cos/sin handed in already broadcastable: [S, D], [1, 1, S, D], [B, 1, S, D]..."""

    def forward(self, x, cos, sin):
        return x * cos + rotate_half(x) * sin


def _check(module, inputs, ropes, rel=1e-5):
    out, report = compile_with_graphopt(module, *inputs, passes=PIPE)
    assert count(report, "graphopt.rope") == ropes, report.op_counts
    for gone in ("aten.neg", "aten.stack"):
        assert count(report, gone) == 0, report.op_counts
    assert_matches_eager(out, eager(module, *inputs), rel=rel)
    return report


def test_rotate_half_on_q_and_k():
    torch.manual_seed(0)
    cos, sin = tables()
    report = _check(RotateHalfQK(), (torch.randn(B, H, S, D), torch.randn(B, 2, S, D), cos, sin), ropes=2)
    assert report.passes[-1].matches == 2


@pytest.mark.parametrize("rotate", [rotate_every_two, rotate_pairs_unbind], ids=["strided_slices", "unbind"])
def test_interleaved(rotate):
    torch.manual_seed(0)
    cos, sin = tables(interleaved=True)
    _check(Interleaved(rotate), (torch.randn(B, H, S, D), cos, sin), ropes=1)


def test_partial_rotary_fuses_the_pass_through_cat():
    torch.manual_seed(0)
    cos, sin = tables(dim=8)
    report = _check(PartialRotary(), (torch.randn(B, H, S, D), cos, sin), ropes=1)
    assert count(report, "aten.cat") == 0 and count(report, "aten.slice") == 0


def test_seq_major_layout_is_transposed_around_the_op():
    torch.manual_seed(0)
    freqs = torch.randn(B, S, 4)
    report = _check(SeqMajorGPTJ(), (torch.randn(B, S, H, D), freqs.sin(), freqs.cos()), ropes=1)
    assert count(report, "aten.stack") == 0


def test_tables_computed_in_graph_with_attention_scaling():
    torch.manual_seed(0)
    _check(LlamaStyleTables(), (torch.randn(B, H, S, D), torch.arange(S).expand(B, S)), ropes=1)


@pytest.mark.parametrize("shape", [(S, D), (1, S, D), (1, 1, S, D), (B, 1, S, D)], ids=str)
def test_table_shapes_are_brought_to_bsr(shape):
    torch.manual_seed(0)
    cos, sin = tables()
    if shape[0] == B:
        cos, sin = cos[:, None], sin[:, None]
    else:
        cos, sin = cos[0].reshape(shape), sin[0].reshape(shape)
    _check(BroadcastTables(), (torch.randn(B, H, S, D), cos, sin), ropes=1)


class HeadsFromProjection(nn.Module):
    """q = proj.view(B, S, H, D).transpose(1, 2): the rope result is laid out [B, S, H, D] in
    memory, and the aot graph views it back to [B, S, H * D] without a copy."""

    def forward(self, x, cos, sin):
        q = x.view(B, S, H, D).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        r = q * cos + rotate_half(q) * sin
        return r.transpose(1, 2).reshape(B, S, H * D)


def test_keeps_the_memory_layout_a_downstream_view_relies_on():
    torch.manual_seed(0)
    cos, sin = tables()
    report = _check(HeadsFromProjection(), (torch.randn(B, S, H * D), cos, sin), ropes=1)
    assert count(report, "aten.clone") == 1  # the op writes [B, H, S, D]; one copy restores the layout


def test_fp16_matches_eager():
    # The op computes x * cos + rotate(x) * sin in fp16 as eager does; 1e-3 allows rounding-order noise.
    torch.manual_seed(0)
    cos, sin = tables()
    module = RotateHalfQK()
    inputs = (torch.randn(B, H, S, D).half(), torch.randn(B, 2, S, D).half(), cos.half(), sin.half())
    out, report = compile_with_graphopt(module, *inputs, passes=PIPE)
    assert count(report, "graphopt.rope") == 2
    assert out[0].dtype == torch.float16
    assert_matches_eager(out, eager(module, *inputs), rel=1e-3)


def test_dynamic_batch_and_sequence():
    # B and S are symbols (head dims stay static, as a model's weights fix them): the tables'
    # expand must read the batch size from the graph.
    torch._dynamo.reset()
    graphopt.reset()
    module = RotateHalfQK()
    compiled = torch.compile(module, backend="graphopt", options={"target": "eager", "fallback": "error",
                                                                  "pipeline": PIPE})
    for batch, seq in ((2, 8), (3, 5)):
        cos, sin = tables(batch=1, seq=seq)
        inputs = (torch.randn(batch, H, seq, D), torch.randn(batch, 2, seq, D), cos, sin)
        for t in inputs:
            torch._dynamo.mark_dynamic(t, t.dim() - 2)
        for t in inputs[:2]:
            torch._dynamo.mark_dynamic(t, 0)
        with torch.no_grad():
            assert_matches_eager(compiled(*inputs), eager(module, *inputs), rel=1e-5)
    assert len(graphopt.reports()) == 1  # one dynamic graph served both shapes
    assert count(graphopt.reports()[0], "graphopt.rope") == 2


# ---------------------------------------------------------------- near misses

class RotatesAnotherTensor(nn.Module):
    def forward(self, x, y, cos, sin):
        return x * cos + rotate_half(y) * sin


class SplitsAtFive(nn.Module):
    def forward(self, x, cos, sin):
        return x * cos + torch.cat((-x[..., 5:], x[..., :5]), dim=-1) * sin


class OppositeRotation(nn.Module):
    def forward(self, x, cos, sin):
        h = x.shape[-1] // 2
        return x * cos + torch.cat((x[..., h:], -x[..., :h]), dim=-1) * sin


class PairsSwapped(nn.Module):
    def forward(self, x, cos, sin):
        return x * cos + torch.stack((-x[..., ::2], x[..., 1::2]), dim=-1).flatten(-2) * sin


class SinCosSwapped(nn.Module):
    def forward(self, x, angles):
        cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
        return x * sin + rotate_half(x) * cos


class RotateReused(nn.Module):
    def forward(self, x, cos, sin):
        r = rotate_half(x)
        return x * cos + r * sin, r


def _angles():
    return torch.randn(B, S, D)


@pytest.mark.parametrize(
    "module, inputs, reason",
    [
        (RotatesAnotherTensor(), (torch.randn(B, H, S, D), torch.randn(B, H, S, D), torch.randn(B, 1, S, D),
                                  torch.randn(B, 1, S, D)), "rotate reads a different tensor"),
        (SplitsAtFive(), (torch.randn(B, H, S, D), torch.randn(B, 1, S, D), torch.randn(B, 1, S, D)),
         "halves split at 5, expected 8"),
        (OppositeRotation(), (torch.randn(B, H, S, D), torch.randn(B, 1, S, D), torch.randn(B, 1, S, D)),
         "opposite rotation"),
        (PairsSwapped(), (torch.randn(B, H, S, D), torch.randn(B, 1, S, D), torch.randn(B, 1, S, D)),
         "expected stack(-x[1::2], x[0::2])"),
        (SinCosSwapped(), (torch.randn(B, H, S, D), _angles()), "cos/sin swapped"),
        (RotateReused(), (torch.randn(B, H, S, D), torch.randn(B, 1, S, D), torch.randn(B, 1, S, D)),
         "has 2 users"),
        (BroadcastTables(), (torch.randn(B, H, S, D), torch.randn(1, H, S, D), torch.randn(1, H, S, D)),
         "varies along both dims 1 and 2"),
        (BroadcastTables(), (torch.randn(B * H, S, D), torch.randn(S, D), torch.randn(S, D)), "x has rank 3"),
    ],
    ids=["other_tensor", "wrong_split", "opposite_sign", "pairs_swapped", "sin_cos_swapped", "second_user",
         "per_head_tables", "rank_3"],
)
def test_skips_when_math_differs(module, inputs, reason):
    out, report = compile_with_graphopt(module, *inputs, passes=PIPE)
    assert count(report, "graphopt.rope") == 0
    reasons = [m.reason for m in report.near_misses if m.pass_name == "fuse_rope"]
    assert any(reason in r for r in reasons), reasons
    assert_matches_eager(out, eager(module, *inputs), rel=1e-6)


# ---------------------------------------------------------------- real models

class Logits(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids, use_cache=False).logits


def _transformers(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "llama":  # rotate-half, q and k apart, GQA
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
        model = transformers.LlamaForCausalLM(config)
    elif name == "gpt_neox":  # partial rotate-half
        config = transformers.GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, vocab_size=128, rotary_pct=0.5)
        model = transformers.GPTNeoXForCausalLM(config)
    else:  # gptj: interleaved, partial, [B, S, H, D]
        config = transformers.GPTJConfig(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, vocab_size=128,
                                         n_positions=64, bos_token_id=0, eos_token_id=0)
        model = transformers.GPTJForCausalLM(config)
    return Logits(model.eval())


@pytest.mark.parametrize("name", ["llama", "gpt_neox", "gptj"])
def test_transformers_models_rope_per_layer_and_match_eager(name):
    module = _transformers(name)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    out, report = compile_with_graphopt(module, ids, passes=PIPE)
    assert count(report, "graphopt.rope") == 2 * 2  # 2 layers, q and k rotate apart
    assert [m for m in report.near_misses if m.pass_name == "fuse_rope"] == []
    assert_matches_eager(out, eager(module, ids), rel=1e-5)


def test_skips_adds_that_are_no_rope_with_a_screened_reason():
    """Residual and bias adds are dismissed before matching, each with its reason, so
    `graphopt debug --why fuse_rope` can say why nothing fired (grouped, not as near misses)."""
    from tests.helpers import aten_graph, run_pass

    class Adds(nn.Module):
        def forward(self, x, y):
            residual = x + y
            products = x * y + y * 2.0  # two products, but no rotate among their factors
            return residual + products

    x, y = torch.randn(B, H, S, D), torch.randn(B, H, S, D)
    result = run_pass("fuse_rope", aten_graph(Adds(), x, y))
    assert result.stats["matches"] == 0
    assert all(m.screened for m in result.near_misses)
    assert sorted(m.reason for m in result.near_misses) == [
        "no factor is a cat or a flattened stack (no rotate)", "not a sum of two products",
        "not a sum of two products"]
