"""Attention: ``softmax(cap(q @ k^T * scale) + mask) @ v  ->  graphopt.attention(q, k, v, mask, scale,
is_causal, softcap)``, from the explicit form or from any of ATen's SDPA ops.

Why: one op is what every backend lowers to its best kernel (a Triton flash kernel, ORT's
GroupQueryAttention, TensorRT's attention layer), with GQA kept implicit: the k/v heads that
``repeat_kv`` copies Hq / Hkv times are read once instead.

Spellings matched:
- ``aten.scaled_dot_product_attention`` (torch.export), ``_scaled_dot_product_flash_attention_for_cpu``
  (aot_autograd on the CPU) and the CUDA ops ``_scaled_dot_product_{flash,efficient,cudnn}_attention``,
  whose tuple results may be read at output 0 only;
- the explicit form of eager attention (transformers' ``attn_implementation="eager"``, older
  BERTs): ``matmul`` or its aot lowering ``expand -> view -> bmm -> view``, the scale as ``* c``
  or ``/ c``, an additive mask, ``_softmax`` with casts around it, eval-mode dropout after it;
- soft-capped scores before the mask, ``tanh(s / c) * c`` (Gemma2's ``attn_logit_softcapping``,
  Grok), in either operand order and through casts: any ``c' * tanh(a * s)`` is the cap |c'|
  of the scores scaled by ``a * c'``, so the constants need not be written as one ``c``;
- GQA through transformers' ``repeat_kv`` (``unsqueeze -> expand -> clone -> view`` of k and v):
  the op reads the [B, Hkv, S, D] tensors and the copies die.
A mask ``where(m, 0, -inf)`` of a boolean m is passed as m. Layout-only copies in front of
q/k/v (``permute -> clone -> permute back``, as fuse_rope leaves to keep strides) are looked
through, so fuse_rope runs first (``requires``); the op's contiguous output is copied back to the layout the
replaced value had when a ``view`` after it depends on that.

Preconditions: dropout_p is 0; the scale and the cap are constants, the cap applies to the
scaled scores before the mask add (a cap of ``s + mask`` is other math); the softmax runs over the last axis;
the second operand of q @ k^T is k transposed on its last two dims; the mask broadcasts to
[B, Hq, Sq, Skv] without widening the scores; ``is_causal`` only where Sq == Skv is known
(SDPA aligns its causal mask top-left, graphopt.attention bottom-right: they agree only then);
no intermediate (scores, probabilities, the SDPA op's other outputs) has another user.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from graphopt import ir
from graphopt.passes._attention_operands import (
    as_bool_mask, check_shapes, narrow_kv, perm, skip_layout_copies, strip_upcast,
)
from graphopt.rewrite import (
    BATCHED_MATMUL_OPS, MUL_OPS, SDPA_OPS, SOFTMAX_OPS, VIEW_OPS, call_args, cast_like, expect, expect_op,
    is_cast, is_op, NoMatch, PatternPass, restride_like, scalar, single_use, strip_casts, val,
)

aten = torch.ops.aten



@dataclass
class AttentionMatch:
    q: fx.Node
    k: fx.Node
    v: fx.Node
    mask: fx.Node | None
    scale: float | None  # None: 1/sqrt(D), the op's default as SDPA's
    is_causal: bool
    output: fx.Node  # the node whose value the op replaces
    sdpa: fx.Node | None = None  # the SDPA op, when the match starts from one
    softcap: float = 0.0  # 0: the scores are not capped


def _call(graph: fx.Graph, target, *args, **kwargs) -> fx.Node:
    node = graph.call_function(target, args, kwargs)
    ir.infer_val(node)
    return node


# ---------------------------------------------------------------- SDPA ops

def _match_sdpa(node: fx.Node) -> AttentionMatch:
    args = call_args(node)
    dropout = args.get("dropout_p", 0.0)
    expect(scalar(dropout) == 0.0, f"dropout_p {dropout}, expected 0", node)
    scale = args.get("scale")
    expect(scale is None or scalar(scale) is not None, "scale is not a constant", node)
    mask = args.get("attn_mask", args.get("attn_bias"))
    is_causal = bool(args.get("is_causal", False))
    if isinstance(val(node), torch.Tensor):
        output = node
    else:
        readers = list(node.users)
        expect(all(u.target is operator.getitem for u in readers), "a tuple output is read by a non-getitem", node)
        others = sorted({u.args[1] for u in readers if u.args[1] != 0})
        expect(not others, f"output {others[0] if others else ''} of {ir.target_name(node.target)} is read; "
               "graphopt.attention returns only output 0", node)
        firsts = [u for u in readers if u.args[1] == 0]
        expect(len(firsts) == 1, f"output 0 is read {len(firsts)} times, expected once", node)
        output = firsts[0]
    q = skip_layout_copies(node.args[0])
    k, v = narrow_kv(node.args[1], node.args[2])
    check_shapes(q, k, v, mask)
    mask = as_bool_mask(mask)
    if is_causal:
        sq, skv = val(q).shape[-2], val(k).shape[-2]
        expect(statically_known_true(sq == skv),
               f"is_causal with Sq {sq} != Skv {skv}: SDPA aligns the causal mask top-left, "
               "graphopt.attention bottom-right", node)
    return AttentionMatch(q, k, v, mask, None if scale is None else scalar(scale), is_causal, output, node)


# ---------------------------------------------------------------- the explicit form

def _flattened_operand(node: fx.Node, what: str) -> fx.Node:
    """The 4-D tensor behind a bmm operand: ``view(clone?(expand?(t)), [B*H, M, K])``."""
    expect_op(node, VIEW_OPS, f"{what} bmm operand")
    inner = node.args[0]
    if is_op(inner, aten.clone.default):
        inner = inner.args[0]
    if is_op(inner, aten.expand.default):
        expect(list(val(inner).shape) == list(val(inner.args[0]).shape),
               f"{what} is broadcast by an expand to {list(val(inner).shape)}", inner)
        inner = inner.args[0]
    shape, flat = tuple(val(inner).shape), tuple(val(node).shape)
    expect(len(shape) == 4 and shape[0] * shape[1] == flat[0] and shape[2:] == flat[1:],
           f"{what} {list(flat)} is not a flattened [B, H, S, D] tensor", node)
    return inner


def _matmul_operands(node: fx.Node, what: str) -> tuple[fx.Node, fx.Node, fx.Node]:
    """(a, b, product) for a 4-D ``a @ b``: a matmul, or ``view(bmm(flat a, flat b), [B, H, M, N])``
    where node is the bmm or the view."""
    if is_op(node, aten.matmul.default):
        a, b = node.args[:2]
        expect(val(a).dim() == 4 and val(b).dim() == 4, f"{what} matmul is not of 4-D tensors", node)
        return a, b, node
    if is_op(node, *VIEW_OPS):
        bmm = expect_op(node.args[0], aten.bmm.default, what)
        view = node
    else:
        bmm = expect_op(node, aten.bmm.default, what)
        expect(len(bmm.users) == 1 and is_op(next(iter(bmm.users)), *VIEW_OPS),
               f"{what} bmm is not viewed back to 4-D", bmm)
        view = next(iter(bmm.users))
    single_use(bmm, what)
    a = _flattened_operand(bmm.args[0], f"{what} lhs")
    b = _flattened_operand(bmm.args[1], f"{what} rhs")
    expect(list(val(view).shape) == list(val(a).shape[:3]) + [val(b).shape[3]],
           f"{what} is not viewed back to [B, H, M, N]", view)
    return a, b, view


def _dropout_input(node: Any) -> fx.Node | None:
    """x for ``getitem(native_dropout(x, p, train), 0)``, else None."""
    if isinstance(node, fx.Node) and node.target is operator.getitem and node.args[1] == 0 \
            and is_op(node.args[0], aten.native_dropout.default):
        return node.args[0].args[0]
    return None


def _probs_source(node: Any) -> fx.Node:
    """The softmax under dropout (eval mode: a clone) and casts."""
    for _ in range(6):
        if is_op(node, aten.clone.default) or is_cast(node):
            node = single_use(node, "attention probs").args[0]
        elif _dropout_input(node) is not None:
            dropout = node.args[0]
            p, train = dropout.args[1], dropout.args[2] if len(dropout.args) > 2 else None
            expect(p == 0 or train is False, f"dropout p={p} on the attention probs (training mode)", dropout)
            node = _dropout_input(single_use(node, "attention probs"))
        else:
            break
    return node


def _split_scale(node: fx.Node) -> tuple[fx.Node, float]:
    """(scores, scale) for ``scores * c``, ``c * scores`` or ``scores / c`` (nested, through casts)."""
    scale = 1.0
    while True:
        if is_cast(node):
            node = single_use(node, "scaled scores cast").args[0]
        elif is_op(node, aten.mul.Tensor, aten.mul.Scalar):
            single_use(node, "scaled scores")
            a, b = node.args[:2]
            if scalar(b) is not None:
                scale, node = scale * scalar(b), a
            elif scalar(a) is not None:
                scale, node = scale * scalar(a), b
            else:
                raise NoMatch("scale is not a constant", node)
        elif is_op(node, aten.div.Tensor, aten.div.Scalar):
            single_use(node, "scaled scores")
            expect(scalar(node.args[1]) is not None, "scale is not a constant", node)
            scale, node = scale / scalar(node.args[1]), node.args[0]
        else:
            return node, scale


def _split_softcap(node: Any) -> tuple[Any, float, float]:
    """(inner, cap, scale factor) for a soft cap ``c * tanh(inner)``: ``c * tanh(a * s)`` equals
    ``|c| * tanh(a * c * s / |c|)``, so the cap is |c| and the scores' scale gains a factor c.
    (node, 0.0, 1.0) when node is no capped value."""
    outer = strip_casts(node)
    if not is_op(outer, *MUL_OPS) or not any(is_op(strip_casts(a), aten.tanh.default) for a in outer.args[:2]):
        return node, 0.0, 1.0
    while node is not outer:  # casts between the cap and the mask add
        node = single_use(node, "soft-capped scores cast").args[0]
    single_use(outer, "soft-capped scores")
    a, b = outer.args[:2]
    tanh, factor = (a, b) if is_op(strip_casts(a), aten.tanh.default) else (b, a)
    expect(scalar(factor) is not None, "softcap: tanh(scores) is multiplied by a non-constant", outer)
    cap = scalar(factor)
    expect(cap != 0.0, "softcap: tanh(scores) is multiplied by 0", outer)
    while is_cast(tanh):
        tanh = single_use(tanh, "soft-capped scores cast").args[0]
    single_use(tanh, "tanh of the scores")
    return tanh.args[0], abs(cap), cap


def _is_scores(node: Any) -> bool:
    """Whether ``node`` is q @ k^T under casts, constant scales and a tanh soft cap (and not,
    say, a mask built as ``(1 - m) * -1e4``)."""
    for _ in range(8):
        if is_cast(node) or is_op(node, aten.tanh.default):
            node = node.args[0]
        elif is_op(node, aten.mul.Tensor, aten.mul.Scalar) and scalar(node.args[0]) is not None:
            node = node.args[1]
        elif is_op(node, aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar):
            node = node.args[0]
        else:
            break
    return is_op(node, aten.matmul.default) or (is_op(node, *VIEW_OPS) and is_op(node.args[0], aten.bmm.default))


def _match_explicit(anchor: fx.Node) -> AttentionMatch:
    probs_in, v, out = _matmul_operands(anchor, "probs @ v")
    softmax = _probs_source(probs_in)
    expect_op(softmax, SOFTMAX_OPS, "attention probs")
    single_use(softmax, "attention probs")
    dim = softmax.args[1]
    expect(dim in (-1, val(softmax).dim() - 1), f"softmax over dim {dim}, expected -1", softmax)
    masked = softmax.args[0]
    if is_cast(masked):
        masked = single_use(masked, "softmax input cast").args[0]
    mask = None
    if is_op(masked, aten.add.Tensor) and "alpha" not in masked.kwargs:
        single_use(masked, "masked scores")
        a, b = masked.args[:2]
        if _is_scores(a):
            scores, mask = a, b
        elif _is_scores(b):
            scores, mask = b, a
        else:
            raise NoMatch("neither operand of the mask add is the scaled q @ k^T", masked)
        expect(isinstance(mask, fx.Node), "mask is a scalar", masked)
    else:
        scores = masked
    if mask is not None and isinstance(val(mask), torch.Tensor):
        expect(val(masked).shape == val(scores).shape, f"mask {list(val(mask).shape)} broadcasts the scores "
               f"{list(val(scores).shape)} up to {list(val(masked).shape)}", masked)
    inner, softcap, factor = _split_softcap(scores)
    raw, scale = _split_scale(inner)
    if softcap:
        expect(_is_scores(raw), "softcap: tanh's input is not the scaled q @ k^T (a cap after the mask "
               "add is not the capped-scores attention)", raw)
    scale *= factor
    single_use(raw, "attention scores")
    q, kt, _ = _matmul_operands(raw, "q @ k^T")
    order = perm(kt)
    expect(order == [0, 1, 3, 2],
           "k is not transposed on the last two dims" + (f" (permutation {order})" if order else ""), kt)
    q = skip_layout_copies(strip_upcast(q))
    k, v = narrow_kv(strip_upcast(kt.args[0]), strip_upcast(v))
    check_shapes(q, k, v, mask)
    return AttentionMatch(q, k, v, as_bool_mask(mask), scale, False, out, softcap=softcap)


def _feeds_on_softmax(anchor: fx.Node) -> bool:
    """Whether the first operand of a matmul comes from a softmax (through views/casts/clones)."""
    node = anchor.args[0]
    for _ in range(8):
        if is_op(node, *SOFTMAX_OPS):
            return True
        if not isinstance(node, fx.Node) or node.op != "call_function" or not node.args:
            return False
        if _dropout_input(node) is not None:
            node = _dropout_input(node)
            continue
        if not (is_op(node, aten.clone.default, aten.expand.default, *VIEW_OPS) or is_cast(node)):
            return False
        node = node.args[0]
    return False


# ---------------------------------------------------------------- the pass

class FuseAttention(PatternPass):
    name = "fuse_attention"
    summary = "softmax(cap(q k^T * scale) + mask) v and the SDPA ops -> graphopt.attention (GQA implicit)"
    anchors = SDPA_OPS + BATCHED_MATMUL_OPS
    # Its k/v matching looks through the permute -> clone -> permute copies that fuse_rope
    # leaves in front of attention; without fuse_rope those copies would split the match.
    requires = ("fuse_rope",)

    def screen(self, anchor: fx.Node) -> str | None:
        # A matmul is worth matching only when it multiplies softmax probabilities: the other
        # matmuls of a model (q @ k^T included) are no attention.
        if anchor.target in SDPA_OPS or _feeds_on_softmax(anchor):
            return None
        return "its first operand is no softmax output (not probs @ v)"

    def match(self, anchor: fx.Node, options) -> AttentionMatch:
        if anchor.target in SDPA_OPS:
            return _match_sdpa(anchor)
        return _match_explicit(anchor)

    def rewrite(self, gm: fx.GraphModule, m: AttentionMatch, options) -> None:
        g = gm.graph
        with g.inserting_before(m.output):
            args = (m.q, m.k, m.v, m.mask, m.scale, m.is_causal) + ((m.softcap,) if m.softcap else ())
            fused = _call(g, torch.ops.graphopt.attention.default, *args)
            result = restride_like(g, cast_like(gm, fused, m.output), m.output)
        m.output.replace_all_uses_with(result)
        if m.sdpa is not None:
            # The CUDA SDPA ops carry the nondeterministic_seeded tag (dropout), which dead-code
            # elimination takes for a side effect: remove the op and its tuple reads here.
            for reader in list(m.sdpa.users):
                if not reader.users:
                    g.erase_node(reader)
            if not m.sdpa.users:
                g.erase_node(m.sdpa)


fuse_attention = FuseAttention()
