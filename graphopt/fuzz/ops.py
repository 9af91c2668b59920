"""Random ops: the building blocks around the planted patterns.

linear, matmul, add, mul (with broadcasting), pow, mean, rsqrt, softmax, silu, gelu, cat,
reshape, transpose, SDPA, dtype casts and identity ops (which ``canonicalize`` removes).
Each keeps a rough bound on its output's RMS (``Value.mag``) and refuses to grow it past
``MAX_MAG``, so a float16 chain never overflows into infs that would hide real bugs.
"""

from __future__ import annotations

import math

from graphopt.fuzz.case import Step, Value
from graphopt.fuzz.kind import MAX_MAG, Gen, OpKind

WIDTHS = (16, 32, 8, 48, 64)


def _fits(mag: float) -> bool:
    return mag <= MAX_MAG


def _val(gen: Gen, shape, mag: float, dtype: str | None = None) -> Value:
    return Value(tuple(shape), dtype or gen.dtype, mag)


# --- linear and matmul ---------------------------------------------------------------------

def draw_linear(gen: Gen, x: int) -> Step | None:
    v = gen.value(x)
    if v.dtype != gen.dtype:
        return None  # the weight has the case's dtype; F.linear refuses mixed dtypes
    n = gen.draw.choice(WIDTHS)
    return gen.step("linear", (x,), _val(gen, v.shape[:-1] + (n,), v.mag + 0.3), n=n, bias=gen.draw.chance(50))


def emit_linear(b, step, a):
    k = b.case.values()[step.args[0]].shape[-1]
    w = b.param(step, "w", (step.p["n"], k), std=1 / math.sqrt(k))
    bias = b.param(step, "b", (step.p["n"],), std=0.1) if step.p["bias"] else "None"
    b.line(f"{b.var(step.id)} = F.linear({a[0]}, {w}, {bias})")


def draw_matmul(gen: Gen, x: int) -> Step | None:
    v = gen.value(x)
    if len(v.shape) < 2:
        return None
    if gen.draw.chance(50) and v.dtype == gen.dtype:
        n = gen.draw.choice(WIDTHS)
        return gen.step("matmul", (x,), _val(gen, v.shape[:-1] + (n,), v.mag), form="weight", n=n)
    y = gen.same_shape(x)
    mag = v.mag * gen.value(y).mag
    if not _fits(mag):
        return None
    shape = v.shape[:-1] + (v.shape[-2],)
    return gen.step("matmul", (x, y), Value(shape, v.dtype, mag), form="x_yT")


def emit_matmul(b, step, a):
    shape = b.case.values()[step.args[0]].shape
    if step.p["form"] == "weight":
        w = b.param(step, "w", (shape[-1], step.p["n"]), std=1 / math.sqrt(shape[-1]))
        b.line(f"{b.var(step.id)} = torch.matmul({a[0]}, {w})")
    else:
        b.line(f"{b.var(step.id)} = torch.matmul({a[0]}, {a[1]}.transpose(-1, -2)) * {1 / math.sqrt(shape[-1]):.6g}")


# --- elementwise binary ops with broadcasting ------------------------------------------------

def _broadcast_shape(gen: Gen, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts to ``shape`` without widening it: leading dims dropped, some set to 1."""
    keep = gen.draw.integer(1, len(shape))
    tail = list(shape[len(shape) - keep:])
    for i in range(len(tail) - 1):  # the last dim stays: [H] is the common bias/scale shape
        if gen.draw.chance(40):
            tail[i] = 1
    return tuple(tail)


def _draw_binary(kind: str):
    def draw(gen: Gen, x: int) -> Step | None:
        v = gen.value(x)
        form = gen.draw.choice(("same", "broadcast_param", "broadcast_input", "scalar"))
        if form == "same":
            y = gen.same_shape(x)
            ym = gen.value(y).mag
            mag = math.hypot(v.mag, ym) if kind == "add" else v.mag * ym
            dtype = v.dtype if gen.value(y).dtype == v.dtype else "float32"
            return gen.step(kind, (x, y), Value(v.shape, dtype, mag), form=form) if _fits(mag) else None
        if form == "scalar":
            c = gen.draw.choice((0.5, 2.0, -1.5))
            mag = v.mag * abs(c) if kind == "mul" else v.mag + abs(c)
            return gen.step(kind, (x,), Value(v.shape, v.dtype, mag), form=form, c=c) if _fits(mag) else None
        shape = _broadcast_shape(gen, v.shape)
        if form == "broadcast_input":
            y = gen.new_input(Value(shape, v.dtype))
            mag = v.mag + 1 if kind == "add" else v.mag * 3
            return gen.step(kind, (x, y), Value(v.shape, v.dtype, mag), form=form) if _fits(mag) else None
        if v.dtype != gen.dtype:
            return None
        return gen.step(kind, (x,), Value(v.shape, v.dtype, v.mag + 1), form=form, shape=shape)
    return draw


def _emit_binary(symbol: str, param_mean: float):
    def emit(b, step, a):
        form = step.p["form"]
        if form == "scalar":
            other = f"{step.p['c']!r}"
        elif form == "broadcast_param":
            other = b.param(step, "c", step.p["shape"], std=0.5, mean=param_mean)
        else:
            other = a[1]
        b.line(f"{b.var(step.id)} = {a[0]} {symbol} {other}")
    return emit


# --- unary ops ---------------------------------------------------------------------------------

def draw_pow(gen: Gen, x: int) -> Step | None:
    v = gen.value(x)
    e = gen.draw.choice((2, 3))
    if not _fits(max(v.mag, 1.5) ** e):
        return None
    return gen.step("pow", (x,), Value(v.shape, v.dtype, max(v.mag, 1.5) ** e), e=e,
                    spelling=gen.draw.choice(("method", "operator", "torch")))


def emit_pow(b, step, a):
    e, out = step.p["e"], b.var(step.id)
    text = {"method": f"{a[0]}.pow({e})", "operator": f"{a[0]} ** {e}", "torch": f"torch.pow({a[0]}, {e})"}
    b.line(f"{out} = {text[step.p['spelling']]}")


def draw_mean(gen: Gen, x: int) -> Step | None:
    v = gen.value(x)
    keepdim = gen.draw.chance(50)
    if len(v.shape) < 2 and not keepdim:
        return None  # a 0-d output would end the chain
    dim = gen.draw.integer(-len(v.shape), -1)
    shape = list(v.shape)
    if keepdim:
        shape[dim] = 1
    else:
        del shape[dim]
    return gen.step("mean", (x,), Value(tuple(shape), v.dtype, v.mag), dim=dim, keepdim=keepdim)


def emit_mean(b, step, a):
    b.line(f"{b.var(step.id)} = {a[0]}.mean({step.p['dim']}, keepdim={step.p['keepdim']})")


def draw_rsqrt(gen: Gen, x: int) -> Step | None:
    v = gen.value(x)
    c = gen.draw.choice((1.0, 0.5))
    return gen.step("rsqrt", (x,), Value(v.shape, v.dtype, 1 / math.sqrt(c)), c=c)


def emit_rsqrt(b, step, a):
    b.line(f"{b.var(step.id)} = torch.rsqrt({a[0]} * {a[0]} + {step.p['c']!r})")  # positive: no NaN


def draw_softmax(gen: Gen, x: int) -> Step | None:
    v = gen.value(x)
    dim = gen.draw.integer(-len(v.shape), -1)
    return gen.step("softmax", (x,), Value(v.shape, v.dtype, 1.0), dim=dim, upcast=gen.draw.chance(30))


def emit_softmax(b, step, a):
    dim = step.p["dim"]
    if step.p["upcast"]:
        b.line(f"{b.var(step.id)} = F.softmax({a[0]}, dim={dim}, dtype=torch.float32).to({a[0]}.dtype)")
    else:
        b.line(f"{b.var(step.id)} = torch.softmax({a[0]}, {dim})")


def _draw_unary(kind: str, **choices):
    def draw(gen: Gen, x: int) -> Step | None:
        v = gen.value(x)
        params = {k: gen.draw.choice(opts) for k, opts in choices.items()}
        return gen.step(kind, (x,), Value(v.shape, v.dtype, v.mag), **params)
    return draw


def emit_silu(b, step, a):
    b.line(f"{b.var(step.id)} = F.silu({a[0]})")


def emit_gelu(b, step, a):
    b.line(f"{b.var(step.id)} = F.gelu({a[0]}, approximate={step.p['approximate']!r})")


def emit_identity(b, step, a):
    text = {"mul_one": f"{a[0]} * 1.0", "add_zero": f"{a[0]} + 0.0", "div_one": f"{a[0]} / 1"}
    b.line(f"{b.var(step.id)} = {text[step.p['form']]}")


def draw_cast(gen: Gen, x: int) -> Step | None:
    v = gen.value(x)
    options = [d for d in ("float32", gen.dtype) if d != v.dtype]
    if gen.dtype == "float32" and v.dtype == "float32":
        options = ["float16"]
    to = gen.draw.choice(options)
    return gen.step("cast", (x,), Value(v.shape, to, v.mag), to=to)


def emit_cast(b, step, a):
    b.line(f"{b.var(step.id)} = {a[0]}.to(torch.{step.p['to']})")


# --- shape ops -----------------------------------------------------------------------------------

def draw_cat(gen: Gen, x: int) -> Step | None:
    v = gen.value(x)
    dim = gen.draw.integer(-len(v.shape), -1)
    y = gen.pick(lambda w: len(w.shape) == len(v.shape) and w.dtype == v.dtype
                 and all(a == b for i, (a, b) in enumerate(zip(w.shape, v.shape)) if i != len(v.shape) + dim))
    if y is None:
        return None
    shape = list(v.shape)
    shape[dim] += gen.value(y).shape[dim]
    return gen.step("cat", (x, y), Value(tuple(shape), v.dtype, max(v.mag, gen.value(y).mag)), dim=dim)


def emit_cat(b, step, a):
    b.line(f"{b.var(step.id)} = torch.cat([{a[0]}, {a[1]}], dim={step.p['dim']})")


def draw_reshape(gen: Gen, x: int) -> Step | None:
    v = gen.value(x)
    forms = [f for f, ok in (("split_last", v.shape[-1] % 2 == 0 and v.shape[-1] >= 4),
                             ("merge_last", len(v.shape) >= 2), ("rows", len(v.shape) >= 3)) if ok]
    if not forms:
        return None
    form = gen.draw.choice(forms)
    if form == "split_last":
        heads = gen.draw.choice([h for h in (2, 4) if v.shape[-1] % h == 0])
        shape = v.shape[:-1] + (heads, v.shape[-1] // heads)
    elif form == "merge_last":
        shape = v.shape[:-2] + (v.shape[-2] * v.shape[-1],)
    else:
        shape = (math.prod(v.shape[:-1]), v.shape[-1])
    return gen.step("reshape", (x,), Value(shape, v.dtype, v.mag), form=form, shape=shape,
                    spelling=gen.draw.choice(("reshape", "view", "flatten")))


def emit_reshape(b, step, a):
    shape, spelling = step.p["shape"], step.p["spelling"]
    if spelling == "flatten" and step.p["form"] == "merge_last":
        b.line(f"{b.var(step.id)} = {a[0]}.flatten(-2)")
    else:
        fn = "view" if spelling == "view" else "reshape"
        # view needs a contiguous input; a transpose before it would make view refuse
        src = f"{a[0]}.contiguous()" if fn == "view" else a[0]
        # sizes read from the input, not written as numbers: the model then runs at other
        # batch and sequence lengths too (the fuzzer calls it at two shapes)
        size = {"split_last": f"{a[0]}.shape[:-1] + {tuple(shape[-2:])!r}",
                "merge_last": f"{a[0]}.shape[:-2] + (-1,)", "rows": f"-1, {shape[-1]}"}[step.p["form"]]
        b.line(f"{b.var(step.id)} = {src}.{fn}({size})")


def draw_transpose(gen: Gen, x: int) -> Step | None:
    v = gen.value(x)
    if len(v.shape) < 2:
        return None
    d0 = gen.draw.integer(-len(v.shape), -2)
    d1 = gen.draw.integer(d0 + 1, -1)
    shape = list(v.shape)
    shape[d0], shape[d1] = shape[d1], shape[d0]
    return gen.step("transpose", (x,), Value(tuple(shape), v.dtype, v.mag), d0=d0, d1=d1)


def emit_transpose(b, step, a):
    b.line(f"{b.var(step.id)} = {a[0]}.transpose({step.p['d0']}, {step.p['d1']})")


def draw_sdpa(gen: Gen, x: int) -> Step | None:
    """SDPA over a [.., S, D] value read as q, with k/v of the same shape."""
    v = gen.value(x)
    if len(v.shape) not in (3, 4) or v.shape[-1] < 4:
        return None
    k, val = gen.same_shape(x), gen.same_shape(x)
    mask = gen.draw.choice(("none", "causal", "additive"))
    args = (x, k, val)
    if mask == "additive":
        args += (gen.new_input(Value(v.shape[-2:-1] * 2, v.dtype)),)  # [S, S], broadcast over batch/heads
    mag = gen.value(val).mag
    return gen.step("sdpa", args, Value(v.shape, v.dtype, mag), mask=mask, scale=gen.draw.choice((None, 0.125)))


def emit_sdpa(b, step, a):
    extra = {"none": "", "causal": ", is_causal=True", "additive": f", attn_mask={a[3] if len(a) > 3 else 'None'}"}
    scale = f", scale={step.p['scale']}" if step.p["scale"] is not None else ""
    b.line(f"{b.var(step.id)} = F.scaled_dot_product_attention({a[0]}, {a[1]}, {a[2]}{extra[step.p['mask']]}{scale})")


KINDS = [
    OpKind("linear", draw_linear, emit_linear),
    OpKind("matmul", draw_matmul, emit_matmul),
    OpKind("add", _draw_binary("add"), _emit_binary("+", 0.0)),
    OpKind("mul", _draw_binary("mul"), _emit_binary("*", 1.0)),
    OpKind("pow", draw_pow, emit_pow),
    OpKind("mean", draw_mean, emit_mean),
    OpKind("rsqrt", draw_rsqrt, emit_rsqrt),
    OpKind("softmax", draw_softmax, emit_softmax),
    OpKind("silu", _draw_unary("silu"), emit_silu),
    OpKind("gelu", _draw_unary("gelu", approximate=("none", "tanh")), emit_gelu),
    OpKind("identity", _draw_unary("identity", form=("mul_one", "add_zero", "div_one")), emit_identity),
    OpKind("cast", draw_cast, emit_cast),
    OpKind("cat", draw_cat, emit_cat),
    OpKind("reshape", draw_reshape, emit_reshape),
    OpKind("transpose", draw_transpose, emit_transpose),
    OpKind("sdpa", draw_sdpa, emit_sdpa),
]
