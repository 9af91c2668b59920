"""Planted normalisation patterns: RMSNorm (every spelling fuse_rms_norm knows), residual
add + RMSNorm, softmax + RMSNorm, LayerNorm (native and decomposed, with or without its
residual add).

Each is planted as written (the pass must fire) or with one perturbation that changes the
math or the data flow (another axis, an eps read from an input, a second user of an
intermediate, a different tensor scaled, an add with alpha or broadcasting): then the pass
must not fire, and must say why in a near miss. ``Step.p["perturb"]`` names which.
"""

from __future__ import annotations

from graphopt.fuzz.case import Expectation, Step, Value
from graphopt.fuzz.kind import Gen, OpKind

RMS_SPELLINGS = ("pow_mean", "hf_upcast", "mul_mean", "gemma", "no_weight")
# The inverse square root, in every spelling fuse_rms_norm knows: rsqrt(v), v.pow(-0.5),
# 1 / sqrt(v), x / sqrt(v), and F.rms_norm whole (only where the norm is plain: its own
# weight, eps a constant, the last axis). Picked by the step's id, not drawn: a new draw
# would have changed every seed's graphs, which regression tests and reproducers replay.
RMS_INVERSES = ("rsqrt", "pow", "reciprocal", "div", "aten")
EPS = (1e-6, 1e-5, 1e-3)

# perturbation -> a substring of the near miss the pass reports for it
RMS_PERTURB = {
    "none": None,
    "other_axis": "mean over dim",
    "eps_input": "eps is not a constant",
    "second_user": "users",
    "other_tensor": "different tensor",
}


def _rms_params(gen: Gen) -> dict:
    return {"spelling": gen.draw.choice(RMS_SPELLINGS), "eps": gen.draw.choice(EPS),
            "weight_left": gen.draw.chance(50)}


def emit_rms(b, step: Step, x: str, hidden: int, spelling: str, eps: str, weight_left: bool,
             axis: int = -1, second_user: bool = False, scaled: str | None = None, tag: str = "") -> str:
    """Write an RMSNorm of ``x`` in ``spelling``; returns the name of its result."""
    t = lambda name: b.tmp(step, tag + name)  # noqa: E731
    inverse = step.p.get("inverse") or RMS_INVERSES[step.id % len(RMS_INVERSES)]
    plain = spelling in ("pow_mean", "no_weight") and axis == -1 and not second_user and scaled is None
    if inverse == "aten" and plain and _is_number(eps):
        out = t("out")
        w = None if spelling == "no_weight" else b.param(step, tag + "w", (hidden,), std=0.1, mean=1.0)
        b.line(f"{out} = F.rms_norm({x}, ({hidden},), {w}, {eps})")
        return out
    if inverse == "aten":
        inverse = "rsqrt"  # a perturbed or dressed-up norm has no F.rms_norm spelling
    h = x
    if spelling == "hf_upcast":
        h = t("h")
        b.line(f"{h} = {x}.to(torch.float32)")
    square = f"{h}.pow(2)" if spelling != "mul_mean" else f"({h} * {h})"
    var = t("var")
    b.line(f"{var} = {square}.mean({axis}, keepdim=True)")
    if second_user:
        b.extra(var)
    src = scaled if scaled is not None else h
    if scaled is not None and spelling == "hf_upcast":
        src = f"{scaled}.to(torch.float32)"
    normed, out = t("normed"), t("out")
    root = {"rsqrt": f"{src} * torch.rsqrt({var} + {eps})", "pow": f"{src} * ({var} + {eps}).pow(-0.5)",
            "reciprocal": f"{src} * (1 / torch.sqrt({var} + {eps}))",
            "div": f"{src} / torch.sqrt({var} + {eps})"}[inverse]
    b.line(f"{normed} = {root}")
    if spelling == "no_weight":
        return normed
    if spelling == "gemma":
        w = b.param(step, tag + "w", (hidden,), std=0.1)
        b.line(f"{out} = {normed} * (1.0 + {w})")
        return out
    w = b.param(step, tag + "w", (hidden,), std=0.1, mean=1.0)
    val = f"{normed}.to({x}.dtype)" if spelling == "hf_upcast" else normed
    b.line(f"{out} = {w} * {val}" if weight_left else f"{out} = {val} * {w}")
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _norm_value(gen: Gen, x: int, spelling: str) -> Value:
    v = gen.value(x)
    return Value(v.shape, v.dtype, 1.5)


# --- RMSNorm ------------------------------------------------------------------------------------

def _normalisable(v: Value) -> bool:
    """A row worth normalising: a norm over one or two elements is degenerate (an unbiased
    variance of one element is NaN), and says nothing about the pass."""
    return len(v.shape) >= 1 and v.shape[-1] >= 4


def draw_rms_norm(gen: Gen, x: int) -> Step | None:
    v = gen.value(x)
    if not _normalisable(v):
        return None
    perturb = gen.draw.choice(tuple(RMS_PERTURB))
    params = _rms_params(gen)
    args: tuple[int, ...] = (x,)
    if perturb == "other_axis" and (len(v.shape) < 2 or v.shape[-2] == 1):
        perturb = "none"  # a mean over a size-1 axis is no perturbation
    if perturb == "eps_input":
        args += (gen.new_input(Value((), "float32"), fill="eps", fill_arg=params["eps"]),)
    if perturb == "other_tensor":
        args += (gen.same_shape(x, fresh_percent=100),)
    if v.dtype != gen.dtype and params["spelling"] != "no_weight":
        params["spelling"] = "no_weight"  # a weight has the case dtype; keep the value's dtype
    mag = 8.0 if perturb in ("other_tensor", "other_axis") else 1.5
    return gen.step("plant_rms_norm", args, Value(v.shape, v.dtype, mag), perturb=perturb, **params)


def emit_rms_norm(b, step, a):
    p = step.p
    hidden = b.case.values()[step.args[0]].shape[-1]
    eps = a[1] if p["perturb"] == "eps_input" else repr(p["eps"])
    scaled = a[1] if p["perturb"] == "other_tensor" else None
    out = emit_rms(b, step, a[0], hidden, p["spelling"], eps, p["weight_left"],
                   axis=-2 if p["perturb"] == "other_axis" else -1,
                   second_user=p["perturb"] == "second_user", scaled=scaled)
    b.line(f"{b.var(step.id)} = {out}")


def expect_rms_norm(step) -> list[Expectation]:
    miss = RMS_PERTURB[step.p["perturb"]]
    return [Expectation("fuse_rms_norm", 0 if miss else 1, miss)]


# --- residual add + RMSNorm ------------------------------------------------------------------------

ADD_PERTURB = {"none": None, "sum_unused": None, "alpha": "alpha", "broadcast": "broadcasts", "product": "add"}


def draw_add_rms_norm(gen: Gen, x: int) -> Step | None:
    v = gen.value(x)
    if v.dtype != gen.dtype or not _normalisable(v):
        return None
    perturb = gen.draw.choice(tuple(ADD_PERTURB))
    params = _rms_params(gen)
    args = (x,) if perturb == "broadcast" else (x, gen.same_shape(x))
    return gen.step("plant_add_rms_norm", args, Value(v.shape, v.dtype, 1.5), perturb=perturb, **params)


def emit_add_rms_norm(b, step, a):
    p = step.p
    hidden = b.case.values()[step.args[0]].shape[-1]
    s = b.tmp(step, "sum")
    if p["perturb"] == "alpha":
        b.line(f"{s} = torch.add({a[0]}, {a[1]}, alpha=2.0)")
    elif p["perturb"] == "broadcast":
        b.line(f"{s} = {a[0]} + {b.param(step, 'bias', (hidden,), std=0.5)}")
    elif p["perturb"] == "product":
        b.line(f"{s} = {a[0]} * {a[1]}")
    else:
        b.line(f"{s} = {a[0]} + {a[1]}")
    out = emit_rms(b, step, s, hidden, p["spelling"], repr(p["eps"]), p["weight_left"])
    b.line(f"{b.var(step.id)} = {out}")
    if p["perturb"] != "sum_unused":
        b.extra(s)  # the residual stream: the sum's second user


def expect_add_rms_norm(step) -> list[Expectation]:
    miss = ADD_PERTURB[step.p["perturb"]]
    return [Expectation("fuse_rms_norm", 1), Expectation("fuse_add_rms_norm", 0 if miss else 1, miss)]


# --- softmax + RMSNorm ---------------------------------------------------------------------------

SOFTMAX_PERTURB = {"none": None, "upcast": None, "softmax_axis": "softmax", "probs_output": "user"}


def draw_softmax_rms_norm(gen: Gen, x: int) -> Step | None:
    v = gen.value(x)
    if v.dtype != gen.dtype or not _normalisable(v):
        return None
    perturb = gen.draw.choice(tuple(SOFTMAX_PERTURB))
    if perturb == "softmax_axis" and (len(v.shape) < 2 or v.shape[-2] == 1):
        perturb = "none"
    return gen.step("plant_softmax_rms_norm", (x,), Value(v.shape, v.dtype, 1.5), perturb=perturb, **_rms_params(gen))


def emit_softmax_rms_norm(b, step, a):
    p = step.p
    hidden = b.case.values()[step.args[0]].shape[-1]
    probs = b.tmp(step, "probs")
    if p["perturb"] == "upcast":
        b.line(f"{probs} = torch.softmax({a[0]}.float(), -1).to({a[0]}.dtype)")
    else:
        b.line(f"{probs} = torch.softmax({a[0]}, {-2 if p['perturb'] == 'softmax_axis' else -1})")
    if p["perturb"] == "probs_output":
        b.extra(probs)
    out = emit_rms(b, step, probs, hidden, p["spelling"], repr(p["eps"]), p["weight_left"])
    b.line(f"{b.var(step.id)} = {out}")


def expect_softmax_rms_norm(step) -> list[Expectation]:
    miss = SOFTMAX_PERTURB[step.p["perturb"]]
    return [Expectation("fuse_rms_norm", 1), Expectation("fuse_softmax_rms_norm", 0 if miss else 1, miss)]


# --- LayerNorm ---------------------------------------------------------------------------------------

LN_SPELLINGS = ("functional", "var_sqrt_div", "mean_sq_rsqrt", "deviation_once", "var_mean")
LN_PERTURB = {"none": None, "unbiased": "correction", "two_dims": "dim", "stats_used": "also read|are used"}


def draw_layer_norm(gen: Gen, x: int) -> Step | None:
    v = gen.value(x)
    if v.dtype != gen.dtype or not _normalisable(v):
        return None
    perturb = gen.draw.choice(tuple(LN_PERTURB))
    if perturb == "two_dims" and (len(v.shape) < 2 or v.shape[-2] == 1):
        perturb = "none"
    residual = gen.draw.chance(40)
    args = (x, gen.same_shape(x)) if residual else (x,)
    return gen.step("plant_layer_norm", args, Value(v.shape, v.dtype, 2.0), perturb=perturb,
                    spelling=gen.draw.choice(LN_SPELLINGS), affine=gen.draw.choice(("both", "weight", "none")),
                    eps=gen.draw.choice((1e-5, 1e-6, 1e-3)), residual=residual)


def emit_layer_norm(b, step, a):
    p = step.p
    shape = b.case.values()[step.args[0]].shape
    t = lambda name: b.tmp(step, name)  # noqa: E731
    x = a[0]
    if p["residual"]:
        x = t("sum")
        b.line(f"{x} = {a[0]} + {a[1]}")
        b.extra(x)
    norm_shape = tuple(shape[-2:]) if p["perturb"] == "two_dims" else (shape[-1],)
    dims = "(-2, -1)" if p["perturb"] == "two_dims" else "-1"
    w = b.param(step, "w", norm_shape, std=0.1, mean=1.0) if p["affine"] != "none" else None
    bias = b.param(step, "b", norm_shape, std=0.1) if p["affine"] == "both" else None
    spelling, eps, out = p["spelling"], p["eps"], b.var(step.id)
    if p["perturb"] == "unbiased":
        spelling = "var_sqrt_div"
    if spelling == "functional":
        if p["perturb"] == "stats_used":
            b.line(f"{t('ln')} = torch.native_layer_norm({x}, {list(norm_shape)}, {w}, {bias}, {eps})")
            b.line(f"{out} = {t('ln')}[0]")
            b.extra(f"{t('ln')}[1]")
        else:
            b.line(f"{out} = F.layer_norm({x}, {norm_shape!r}, {w}, {bias}, {eps})")
        return
    mean, normed = t("mean"), t("normed")
    if spelling == "var_mean":
        b.line(f"{t('var')}, {mean} = torch.var_mean({x}, {dims}, keepdim=True, correction=0)")
        b.line(f"{normed} = ({x} - {mean}) / torch.sqrt({t('var')} + {eps})")
    elif spelling == "var_sqrt_div":
        b.line(f"{mean} = {x}.mean({dims}, keepdim=True)")
        correction = 1 if p["perturb"] == "unbiased" else 0
        b.line(f"{t('var')} = {x}.var({dims}, keepdim=True, correction={correction})")
        b.line(f"{normed} = ({x} - {mean}) / torch.sqrt({t('var')} + {eps})")
    elif spelling == "mean_sq_rsqrt":
        b.line(f"{mean} = {x}.mean({dims}, keepdim=True)")
        b.line(f"{t('var')} = ({x} - {mean}).pow(2).mean({dims}, keepdim=True)")
        b.line(f"{normed} = ({x} - {mean}) * torch.rsqrt({t('var')} + {eps})")
    else:  # deviation_once
        b.line(f"{mean} = {x}.mean({dims}, keepdim=True)")
        b.line(f"{t('dev')} = {x} - {mean}")
        b.line(f"{normed} = {t('dev')} * torch.rsqrt(({t('dev')} * {t('dev')}).mean({dims}, keepdim=True) + {eps})")
    if p["perturb"] == "stats_used":
        b.extra(mean)
    expr = normed
    if w:
        expr = f"{expr} * {w}"
    if bias:
        expr = f"{expr} + {bias}"
    b.line(f"{out} = {expr}")


def expect_layer_norm(step) -> list[Expectation]:
    miss = LN_PERTURB[step.p["perturb"]]
    return [Expectation("fuse_layer_norm", 0 if miss else 1, miss)]


KINDS = [
    OpKind("plant_rms_norm", draw_rms_norm, emit_rms_norm, expect_rms_norm),
    OpKind("plant_add_rms_norm", draw_add_rms_norm, emit_add_rms_norm, expect_add_rms_norm),
    OpKind("plant_softmax_rms_norm", draw_softmax_rms_norm, emit_softmax_rms_norm, expect_softmax_rms_norm),
    OpKind("plant_layer_norm", draw_layer_norm, emit_layer_norm, expect_layer_norm),
]
