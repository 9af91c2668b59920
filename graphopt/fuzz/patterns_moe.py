"""Planted mixture-of-experts blocks: the router (softmax, top-k, optional renormalisation),
tokens sorted by expert through two grouped GEMMs with SwiGLU between them, the weighted
unsorted sum over k, and optionally a shared expert with its sigmoid gate (Qwen2-MoE).

Written as transformers' ``grouped_mm`` experts implementation writes it in bfloat16, with
``torch._grouped_mm``: aten's grouped GEMM traces only in bfloat16 (its meta function
refuses other dtypes; transformers then calls its own custom op, which a standalone
reproducer cannot import), so the block is planted in bfloat16 cases only.

As in ``patterns_norm``: planted as written ``fuse_moe`` must fire; with a perturbation (GELU
experts, a sigmoid router, the k smallest probabilities) it must not, and must say why in a
near miss.
"""

from __future__ import annotations

import math

from graphopt.fuzz.case import Expectation, Step, Value
from graphopt.fuzz.kind import Gen, OpKind

# perturbation -> a substring of fuse_moe's near miss
MOE_PERTURB = {
    "none": None,
    "gelu_experts": "expected graphopt.swiglu, found graphopt.geglu",
    "sigmoid_router": "router probabilities",
    "smallest_k": "topk is not the largest k",
}


def draw_moe(gen: Gen, x: int) -> Step | None:
    v = gen.value(x)
    # grouped_mm wants 16-byte aligned rows: a hidden size that is a multiple of 8.
    if v.dtype != gen.dtype or len(v.shape) < 2 or v.shape[-1] % 8:
        return None
    perturb = gen.draw.choice(tuple(MOE_PERTURB))
    experts = gen.draw.choice((4, 3, 6))
    shared = gen.draw.chance(40)
    return gen.step("plant_moe", (x,), Value(v.shape, v.dtype, v.mag + 1.0), perturb=perturb, experts=experts,
                    k=gen.draw.choice((2, 1)), normalize=gen.draw.chance(50), inter=gen.draw.choice((16, 32, 24)),
                    shared=shared)


def emit_moe(b, step, a):
    p = step.p
    hidden = b.case.values()[step.args[0]].shape[-1]
    t = lambda name: b.tmp(step, name)  # noqa: E731
    e, k, inter = p["experts"], p["k"], p["inter"]
    x = t("x")
    b.line(f"{x} = {a[0]}.reshape(-1, {hidden})")
    b.line(f"{t('logits')} = F.linear({x}, {b.param(step, 'wr', (e, hidden), std=1 / math.sqrt(hidden))})")
    score = "torch.sigmoid" if p["perturb"] == "sigmoid_router" else "lambda s: torch.softmax(s, dim=-1)"
    b.line(f"{t('probs')} = ({score})({t('logits')}.float())")
    largest = p["perturb"] != "smallest_k"
    b.line(f"{t('topv')}, {t('topi')} = torch.topk({t('probs')}, {k}, dim=-1, largest={largest})")
    if p["normalize"]:
        b.line(f"{t('topv')} = {t('topv')} / {t('topv')}.sum(dim=-1, keepdim=True)")
    b.line(f"{t('ids')}, {t('perm')} = torch.sort({t('topi')}.reshape(-1))")
    b.line(f"{t('xs')} = {x}[{t('perm')} // {k}]")
    b.line(f"{t('ws')} = {t('topv')}.reshape(-1)[{t('perm')}]")
    counts = f"torch.histc({t('ids')}.float(), bins={e}, min=0, max={e - 1})"
    b.line(f"{t('offs')} = torch.cumsum({counts}, dim=0, dtype=torch.int32)")
    w_gu = b.param(step, "wgu", (e, 2 * inter, hidden), std=1 / math.sqrt(hidden))
    w_d = b.param(step, "wd", (e, hidden, inter), std=1 / math.sqrt(inter))
    b.line(f"{t('gu')} = torch._grouped_mm({t('xs')}, {w_gu}.transpose(-2, -1), offs={t('offs')})")
    b.line(f"{t('g')}, {t('u')} = {t('gu')}.chunk(2, dim=-1)")
    act = "F.gelu({}, approximate='tanh')" if p["perturb"] == "gelu_experts" else "F.silu({})"
    b.line(f"{t('h')} = {act.format(t('g'))} * {t('u')}")
    b.line(f"{t('y')} = torch._grouped_mm({t('h')}, {w_d}.transpose(-2, -1), offs={t('offs')})")
    b.line(f"{t('y')} = {t('y')} * {t('ws')}.unsqueeze(-1)")
    b.line(f"{t('inv')} = torch.empty_like({t('perm')})")
    b.line(f"{t('inv')}[{t('perm')}] = torch.arange({t('perm')}.size(0), device={x}.device)")
    b.line(f"{t('out')} = {t('y')}[{t('inv')}].view(-1, {k}, {hidden}).sum(dim=1).to({x}.dtype)")
    if p["shared"]:
        s_inter = 2 * inter
        w_sgu = b.param(step, "wsgu", (2 * s_inter, hidden), std=1 / math.sqrt(hidden))
        w_sd = b.param(step, "wsd", (hidden, s_inter), std=1 / math.sqrt(s_inter))
        b.line(f"{t('sg')}, {t('su')} = F.linear({x}, {w_sgu}).chunk(2, dim=-1)")
        b.line(f"{t('shared')} = F.linear(F.silu({t('sg')}) * {t('su')}, {w_sd})")
        gate = f"F.linear({x}, {b.param(step, 'wsg', (1, hidden), std=1 / math.sqrt(hidden))})"
        b.line(f"{t('out')} = {t('out')} + torch.sigmoid({gate}) * {t('shared')}")
    b.line(f"{b.var(step.id)} = {t('out')}.view({a[0]}.shape)")


def expect_moe(step) -> list[Expectation]:
    p = step.p
    miss = MOE_PERTURB[p["perturb"]]
    # the experts' activation (GELU too: GeGLU) and the shared expert's are gated MLPs
    return [Expectation("fuse_moe", 0 if miss else 1, miss), Expectation("fuse_gated_mlp", 1 + p["shared"])]


KINDS = [OpKind("plant_moe", draw_moe, emit_moe, expect_moe, dtypes=("bfloat16",))]
