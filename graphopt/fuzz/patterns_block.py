"""Planted transformer-block patterns: GELU with its bias, the gated MLP (SwiGLU / GeGLU),
and attention (q/k/v projections split into heads, rotary embedding, SDPA or the explicit
softmax form, grouped-query heads, the output projection).

As in ``patterns_norm``: planted as written the passes must fire; with a perturbation
(a second user of an intermediate, a wrong constant, a bias that is not a vector, inputs
that differ, a rotation with the wrong sign, the probabilities read outside) they must not,
and must say why in a near miss.
"""

from __future__ import annotations

import math

from graphopt.fuzz.case import Expectation, Step, Value
from graphopt.fuzz.kind import Gen, OpKind

# --- GELU with bias ------------------------------------------------------------------------------

GELU_SPELLINGS = ("linear", "bias_add", "tanh_by_hand", "erf_by_hand")
GELU_PERTURB = {"none": None, "bias_second_user": "also read", "wrong_constant": "expected", "bias_not_vector": "bias"}


def draw_bias_gelu(gen: Gen, x: int) -> Step | None:
    v = gen.value(x)
    if v.dtype != gen.dtype:
        return None
    spelling = gen.draw.choice(GELU_SPELLINGS)
    perturb = gen.draw.choice(tuple(GELU_PERTURB))
    if perturb == "wrong_constant" and not spelling.endswith("by_hand"):
        perturb = "none"
    if perturb == "bias_not_vector" and (spelling == "linear" or len(v.shape) < 2):
        perturb = "none"
    n = gen.draw.choice((32, 64, 16)) if spelling == "linear" else v.shape[-1]
    return gen.step("plant_bias_gelu", (x,), Value(v.shape[:-1] + (n,), v.dtype, v.mag + 1.0), spelling=spelling,
                    perturb=perturb, n=n, approximate=gen.draw.choice(("none", "tanh")))


def emit_bias_gelu(b, step, a):
    p = step.p
    shape = b.case.values()[step.args[0]].shape
    h, out = b.tmp(step, "h"), b.var(step.id)
    if p["spelling"] == "linear":
        w = b.param(step, "w", (p["n"], shape[-1]), std=1 / math.sqrt(shape[-1]))
        b.line(f"{h} = F.linear({a[0]}, {w}, {b.param(step, 'b', (p['n'],), std=0.1)})")
    else:
        bias_shape = tuple(shape[-2:]) if p["perturb"] == "bias_not_vector" else (shape[-1],)
        b.line(f"{h} = {a[0]} + {b.param(step, 'b', bias_shape, std=0.1)}")
    if p["perturb"] == "bias_second_user":
        b.extra(h)
    if p["spelling"] == "tanh_by_hand":
        c = 0.05 if p["perturb"] == "wrong_constant" else 0.044715
        b.line(f"{out} = 0.5 * {h} * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * ({h} + {c} * torch.pow({h}, 3))))")
    elif p["spelling"] == "erf_by_hand":
        c = "1.5" if p["perturb"] == "wrong_constant" else "math.sqrt(2.0)"
        b.line(f"{out} = {h} * 0.5 * (1.0 + torch.erf({h} / {c}))")
    else:
        b.line(f"{out} = F.gelu({h}, approximate={p['approximate']!r})")


def expect_bias_gelu(step) -> list[Expectation]:
    miss = GELU_PERTURB[step.p["perturb"]]
    return [Expectation("fuse_bias_gelu", 0 if miss else 1, miss)]


# --- gated MLP -------------------------------------------------------------------------------------

MLP_PERTURB = {"none": None, "gate_second_user": "user", "up_other_input": "input"}


def draw_gated_mlp(gen: Gen, x: int) -> Step | None:
    v = gen.value(x)
    if v.dtype != gen.dtype:
        return None
    perturb = gen.draw.choice(tuple(MLP_PERTURB))
    args = (x, gen.same_shape(x, fresh_percent=100)) if perturb == "up_other_input" else (x,)
    return gen.step("plant_gated_mlp", args, Value(v.shape, v.dtype, v.mag + 1.0), perturb=perturb,
                    act=gen.draw.choice(("silu", "gelu", "gelu_tanh")), inner=gen.draw.choice((64, 32, 96)),
                    bias=gen.draw.choice(("none", "both", "gate")), act_first=gen.draw.chance(50))


def emit_gated_mlp(b, step, a):
    p = step.p
    k = b.case.values()[step.args[0]].shape[-1]
    t = lambda name: b.tmp(step, name)  # noqa: E731
    std = 1 / math.sqrt(k)
    gate_bias = b.param(step, "bg", (p["inner"],), std=0.1) if p["bias"] != "none" else "None"
    up_bias = b.param(step, "bu", (p["inner"],), std=0.1) if p["bias"] == "both" else "None"
    up_input = a[1] if p["perturb"] == "up_other_input" else a[0]
    b.line(f"{t('gate')} = F.linear({a[0]}, {b.param(step, 'wg', (p['inner'], k), std=std)}, {gate_bias})")
    b.line(f"{t('up')} = F.linear({up_input}, {b.param(step, 'wu', (p['inner'], k), std=std)}, {up_bias})")
    if p["perturb"] == "gate_second_user":
        b.extra(t("gate"))
    act = {"silu": "F.silu({})", "gelu": "F.gelu({})", "gelu_tanh": "F.gelu({}, approximate='tanh')"}[p["act"]]
    act = act.format(t("gate"))
    product = f"{act} * {t('up')}" if p["act_first"] else f"{t('up')} * {act}"
    b.line(f"{t('h')} = {product}")
    w_down = b.param(step, "wd", (k, p["inner"]), std=1 / math.sqrt(p["inner"]))
    b.line(f"{b.var(step.id)} = F.linear({t('h')}, {w_down})")


def expect_gated_mlp(step) -> list[Expectation]:
    miss = MLP_PERTURB[step.p["perturb"]]
    return [Expectation("fuse_gated_mlp", 0 if miss else 1, miss)]


# --- attention: QKV projections + rope + SDPA -----------------------------------------------------------

ATTN_PERTURB = {"none": None, "cross": "merge_qkv", "rope_wrong_sign": "fuse_rope", "probs_output": "fuse_attention"}


def draw_attention(gen: Gen, x: int) -> Step | None:
    v = gen.value(x)
    if v.dtype != gen.dtype or len(v.shape) != 3:
        return None  # [B, S, E]
    perturb = gen.draw.choice(tuple(ATTN_PERTURB))
    heads = gen.draw.choice((2, 4))
    kv_heads = gen.draw.choice((heads, heads // 2))
    head_dim = gen.draw.choice((8, 16))
    rope = gen.draw.choice(("rotate_half", "none", "interleaved"))
    form = gen.draw.choice(("sdpa", "explicit"))
    if perturb == "rope_wrong_sign":
        rope = "rotate_half"
    if perturb == "probs_output":
        form = "explicit"
    args = (x, gen.same_shape(x, fresh_percent=100)) if perturb == "cross" else (x,)
    if rope != "none":
        suffix = "_interleaved" if rope == "interleaved" else ""
        table = Value((v.shape[1], head_dim), v.dtype)
        args += (gen.new_input(table, fill="cos" + suffix), gen.new_input(table, fill="sin" + suffix))
    return gen.step("plant_attention", args, Value(v.shape, v.dtype, v.mag + 1.0), perturb=perturb, heads=heads,
                    kv_heads=kv_heads, head_dim=head_dim, rope=rope, form=form, causal=gen.draw.chance(50),
                    gqa=gen.draw.choice(("repeat_kv", "enable_gqa")), bias=gen.draw.chance(30))


def emit_attention(b, step, a):
    p = step.p
    emb = b.case.values()[step.args[0]].shape[-1]
    # batch and sequence sizes are read from the input, so the model runs at other lengths
    bsz, seq = f"{a[0]}.shape[0]", f"{a[0]}.shape[1]"
    t = lambda name: b.tmp(step, name)  # noqa: E731
    hq, hkv, d = p["heads"], p["kv_heads"], p["head_dim"]
    q_input = a[1] if p["perturb"] == "cross" else a[0]
    for name, heads, src in (("q", hq, q_input), ("k", hkv, a[0]), ("v", hkv, a[0])):
        w = b.param(step, "w" + name, (heads * d, emb), std=1 / math.sqrt(emb))
        bias = b.param(step, "b" + name, (heads * d,), std=0.1) if p["bias"] else "None"
        b.line(f"{t(name)} = F.linear({src}, {w}, {bias}).view({bsz}, {seq}, {heads}, {d}).transpose(1, 2)")
    if p["rope"] != "none":
        cos, sin = a[-2], a[-1]
        rotate = {"rotate_half": "rotate_half", "interleaved": "rotate_every_two"}[p["rope"]]
        if p["perturb"] == "rope_wrong_sign":
            rotate = "rotate_half_wrong_sign"
        b.helper(rotate)
        for name in ("q", "k"):
            b.line(f"{t(name + 'r')} = {t(name)} * {cos} + {rotate}({t(name)}) * {sin}")
        q, k = t("qr"), t("kr")
    else:
        q, k = t("q"), t("k")
    v, groups = t("v"), hq // hkv
    if groups > 1 and (p["gqa"] == "repeat_kv" or p["form"] == "explicit"):
        b.helper("repeat_kv")
        b.line(f"{t('kx')}, {t('vx')} = repeat_kv({k}, {groups}), repeat_kv({v}, {groups})")
        k, v = t("kx"), t("vx")
    if p["form"] == "sdpa":
        gqa = ", enable_gqa=True" if groups > 1 and p["gqa"] == "enable_gqa" else ""
        b.line(f"{t('o')} = F.scaled_dot_product_attention({q}, {k}, {v}, is_causal={p['causal']}{gqa})")
    else:
        b.line(f"{t('scores')} = torch.matmul({q}, {k}.transpose(-2, -1)) / math.sqrt({d})")
        if p["causal"]:
            keep = f"torch.ones({seq}, {seq}, dtype=torch.bool).tril()"
            b.line(f"{t('mask')} = torch.zeros({seq}, {seq}, dtype={q}.dtype).masked_fill(~{keep}, float('-inf'))")
            b.line(f"{t('scores')} = {t('scores')} + {t('mask')}")
        b.line(f"{t('probs')} = torch.softmax({t('scores')}.float(), dim=-1).to({q}.dtype)")
        if p["perturb"] == "probs_output":
            b.extra(t("probs"))
        b.line(f"{t('o')} = torch.matmul({t('probs')}, {v})")
    w_out = b.param(step, "wo", (emb, hq * d), std=1 / math.sqrt(hq * d))
    b.line(f"{b.var(step.id)} = F.linear({t('o')}.transpose(1, 2).reshape({bsz}, {seq}, {hq * d}), {w_out})")


def expect_attention(step) -> list[Expectation]:
    p = step.p
    broken = ATTN_PERTURB[p["perturb"]]
    out = [Expectation("merge_qkv", 0 if broken == "merge_qkv" else 1,
                       "same input" if broken == "merge_qkv" else None)]
    if p["rope"] != "none":
        wrong = broken == "fuse_rope"
        out.append(Expectation("fuse_rope", 0 if wrong else 2, "opposite" if wrong else None))
    wrong = broken == "fuse_attention"
    out.append(Expectation("fuse_attention", 0 if wrong else 1, "user" if wrong else None))
    return out


KINDS = [
    OpKind("plant_bias_gelu", draw_bias_gelu, emit_bias_gelu, expect_bias_gelu),
    OpKind("plant_gated_mlp", draw_gated_mlp, emit_gated_mlp, expect_gated_mlp),
    OpKind("plant_attention", draw_attention, emit_attention, expect_attention),
]
