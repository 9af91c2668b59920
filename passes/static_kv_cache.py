"""Static KV cache: ``attention(q, cat([past_k, new_k], seq), cat([past_v, new_v], seq), mask)  ->
kv_cache_update(cache_k, new_k, pos); kv_cache_update(cache_v, new_v, pos);
cache_attention(q, cache_k, cache_v, lengths = pos + S_new, layout, block_table, scales, mask)``.

Attention that reads the two caches whole (``graphopt.attention`` or SDPA after
fuse_attention folded GQA's repeat_kv) becomes ``graphopt.cache_attention`` on the raw
buffers: it reads only positions below each row's valid length, int8 bytes with their
scales and paged blocks through the table, so step t costs O(t), not O(max_length).
Attention that reads the cache through other views (unfused repeat_kv, the explicit
matmul form) keeps ``attention(..., mask & (j < pos + S_new))`` over a dense read.

Why: a cache that grows by concatenation changes every decode step's shapes (so a
compiled step recompiles, or runs a dynamic-shape graph) and copies the whole cache each
step. A preallocated cache of ``max_length`` positions, written in place at ``pos``, gives
every step identical shapes: one compiled graph serves all of them, memory is allocated
once, and CUDA graphs can capture the step.

The rewrite changes the graph's interface, so it runs only when ``max_length`` is set,
which ``graphopt.generate`` does (it owns the cache buffers; passes/README.md says why
this is the one pass allowed to introduce in-place mutation):
- each past input [B, H, S_past, D] becomes a static cache input in ``layout`` (int8
  plus a scales input with ``kv_dtype="int8"``); ``cache_position`` (0-d int64 = S_past)
  and, for ``paged``, ``block_table`` are appended; the spec lands in
  ``gm.meta["graphopt_static_kv_cache"]`` (``graphopt.ops.kv_cache.StaticCacheSpec``);
- the concatenated caches leave the outputs (the caller owns the buffers; no output aliases them);
- every use of the past length is re-expressed: as a size it is the key length, which becomes
  ``max_length``; as a value (HF's cache_position, a causal mask's query offset) it becomes ``pos``.

Spellings matched: our models/llama.py (explicit past inputs, ``torch.cat`` on dim 2) and
Hugging Face's DynamicCache (``torch.cat`` on dim -2, after a lazy-init cat of an empty
tensor), read by ``aten.scaled_dot_product_attention`` (any of its ATen variants),
``graphopt.attention``, or the explicit form (``softmax(q @ k^T * s + mask) @ v`` as
``bmm``/``matmul``, whose softmax input gets the validity mask), directly or through GQA's
repeat_kv views.
Preconditions: the graph comes from torch.export with a dynamic past length (a static one
cannot be told apart from other sizes) and static other shapes; the concatenated cache
feeds only attention k/v (through views), outputs and size queries; no SDPA ``is_causal``
over a cache (top-left alignment is wrong there); every use of the past length is a size
equal to the key length or a value added to a tensor.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.ops.kv_cache import SPEC_KEY
from graphopt.pass_manager import NearMiss, PassContext, PassResult
from graphopt.passes._static_kv_rebuild import rebuild
from graphopt.passes._static_kv_types import CacheMatch, Options
from graphopt.rewrite import (
    BATCHED_MATMUL_OPS, SCORE_OPS, SDPA_OPS, SOFTMAX_OPS, TRANSPARENT_OPS, NoMatch, expect, is_op, val,
)

aten = torch.ops.aten


def _is_empty_constant(node: fx.Node) -> bool:
    v = val(node)
    if not isinstance(v, torch.Tensor) or v.numel() != 0 or isinstance(v.numel(), torch.SymInt):
        return False
    while is_op(node, aten.clone.default, aten.alias.default, aten.lift_fresh_copy.default):
        node = node.args[0]
    return node.op == "get_attr"


def past_input(node: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """(placeholder, chain) when ``node`` is a graph input, or HF's lazy-init ``cat([empty, input])``."""
    chain = []
    while isinstance(node, fx.Node):
        if node.op == "placeholder":
            return node, chain
        if is_op(node, aten.cat.default) and len(node.args[0]) >= 2 and all(
                _is_empty_constant(a) for a in node.args[0][:-1]):
            chain.append(node)
            node = node.args[0][-1]
            continue
        return None
    return None


def _is_static(v: torch.Tensor) -> bool:
    return all(isinstance(s, int) for s in v.shape)


def _attention_slot(user: fx.Node, value: fx.Node) -> str | None:
    """'k' or 'v' when ``user`` is an attention op reading ``value`` there."""
    if not (is_op(user, *SDPA_OPS) or ir.target_name(user.target) == "graphopt.attention"):
        return None
    names = [a.name for a in user.target._schema.arguments]
    bound = dict(zip(names, user.args)) | dict(user.kwargs)
    keys = ("key", "value") if "key" in bound else ("k", "v")
    if bound.get(keys[0]) is value:
        return "k"
    if bound.get(keys[1]) is value:
        return "v"
    return None


def _scales(user: fx.Node, value: fx.Node) -> bool:
    """``value * c`` or ``value / c`` for a scalar c (decomposed SDPA scales k by sqrt(scale)):
    each position stays where it was, so the unwritten tail stays confined to the tail."""
    if not is_op(user, aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar) or user.args[0] is not value:
        return False
    other = user.args[1]
    return not isinstance(other, fx.Node) or (isinstance(val(other), torch.Tensor) and val(other).numel() == 1)


def _symbolic_last(node: fx.Node) -> bool:
    v = val(node)
    return isinstance(v, torch.Tensor) and isinstance(v.shape[-1], torch.SymInt)


def softmax_of_scores(scores: fx.Node) -> fx.Node:
    """The softmax over the key axis that ``scores`` (q @ k^T, explicit attention) feeds."""
    todo, seen = [scores], set()
    while todo:
        node = todo.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if is_op(user, *SOFTMAX_OPS):
                expect(user.args[1] in (-1, val(user).dim() - 1), f"softmax over dim {user.args[1]}, expected the "
                       "key axis (last)", user)
                return user
            if is_op(user, *SCORE_OPS):
                todo.append(user)
    raise NoMatch(f"the scores {scores.name} = q @ k^T reach no softmax over the key axis", scores)


def _is_candidate(cat: fx.Node) -> bool:
    """A cat whose first operand is a 4-D graph input, on axis 2: what a K/V cache append looks like."""
    tensors = cat.args[0]
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    found = past_input(tensors[0]) if tensors and isinstance(tensors[0], fx.Node) else None
    v = val(found[0]) if found else None
    return isinstance(v, torch.Tensor) and v.dim() == 4 and dim in (2, -2)


def match_cache(cat: fx.Node) -> CacheMatch:
    """A cat of a past input and new K/V on the sequence axis that only attention reads."""
    tensors, dim = cat.args[0], (cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0))
    expect(len(tensors) == 2, f"cat of {len(tensors)} tensors, expected [past, new]", cat)
    found = past_input(tensors[0])
    expect(found is not None, "the first operand is not a graph input (past K/V)", cat)
    past, chain = found
    pv, nv = val(past), val(tensors[1])
    expect(isinstance(pv, torch.Tensor) and pv.dim() == 4, f"past input {past.name} is not 4-D [B, H, S, D]", past)
    expect(dim in (2, -2), f"cat on dim {dim}, expected the sequence axis 2 of [B, H, S, D]", cat)
    expect(isinstance(pv.shape[2], torch.SymInt),
           f"past length of {past.name} is static ({pv.shape[2]}); export with a dynamic past length", past)
    expect(all(isinstance(s, int) for i, s in enumerate(pv.shape) if i != 2),
           f"past input {past.name} {ir.describe_val(pv)} has a dynamic dim other than the length", past)
    expect(isinstance(nv, torch.Tensor) and _is_static(nv), f"new K/V {tensors[1].name} has a dynamic shape",
           tensors[1])
    expect((nv.shape[0], nv.shape[1], nv.shape[3]) == (pv.shape[0], pv.shape[1], pv.shape[3]),
           f"new K/V {ir.describe_val(nv)} does not match past {ir.describe_val(pv)}", tensors[1])
    for node, nxt in zip([past, *chain], [*chain, cat]):
        others = [u for u in node.users if u is not nxt and not is_op(u, aten.sym_size.int)]
        expect(not others, f"past input {past.name} is also read by {others[0].name if others else ''}; "
               "only the cat may read it", others[0] if others else node)
    attentions: list[fx.Node] = []
    softmaxes: list[fx.Node] = []
    todo = [(cat, True)]
    while todo:
        value, direct = todo.pop()
        for user in value.users:
            if user.op == "output":
                expect(direct, f"output reads {value.name}, a view of the concatenated cache: "
                       "an output must not alias the static cache", value)
            elif is_op(user, aten.sym_size.int):
                continue
            elif _attention_slot(user, value):
                attentions.append(user)
            elif is_op(user, *BATCHED_MATMUL_OPS) and user.args[1] is value:
                # Explicit attention: q @ k^T has the key axis last and must be masked before its
                # softmax; probs @ v reads the cache rows those zero probabilities skip.
                if _symbolic_last(user):
                    softmaxes.append(softmax_of_scores(user))
                attentions.append(user)
            elif is_op(user, *TRANSPARENT_OPS) and user.args[0] is value or _scales(user, value):
                todo.append((user, False))
            else:
                raise NoMatch(f"the concatenated cache feeds {ir.target_name(user.target)} ({user.name}), not "
                              "attention k/v: only attention may read a static cache's unwritten tail", user)
    expect(attentions, "the concatenated cache reaches no attention op", cat)
    return CacheMatch(cat, past, tensors[1], chain, attentions, softmaxes)


class StaticKVCache:
    name = "static_kv_cache"
    summary = "rewrite a cache grown by cat into a preallocated cache updated in place at a position"
    Options = Options
    requires: tuple[str, ...] = ()

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        options = ctx.options_for(self)
        if options.max_length <= 0:
            miss = NearMiss(self.name, "graph", "graph", "max_length is not set: the rewrite changes the graph's "
                            "inputs, so it runs only for graphopt.generate, which sets it")
            return PassResult(gm, modified=False, stats={"matches": 0}, near_misses=[miss])
        matches, misses = [], []
        for cat in [n for n in gm.graph.nodes if is_op(n, aten.cat.default)]:
            if not _is_candidate(cat):
                continue  # not a cache cat (rotate-half, HF's lazy init, a cat of other inputs)
            try:
                matches.append(match_cache(cat))
            except NoMatch as miss:
                misses.append(NearMiss(self.name, cat.name, (miss.node or cat).name, miss.reason))
        if not matches and not misses:
            misses.append(NearMiss(self.name, "graph", "graph", "no graph input is concatenated with new K/V on "
                                   "the sequence axis (a cache grown by torch.cat)"))
        if misses or not matches:
            return PassResult(gm, modified=False, stats={"matches": 0}, near_misses=misses)
        allowed = [ctx.allow_rewrite(self.name, m.cat) for m in matches]  # one rewrite per cache, all counted
        if not all(allowed):
            # All or nothing: half the caches static would leave the step's shapes dynamic.
            stop = matches[allowed.index(False)].cat.name
            return PassResult(gm, modified=False, stats={"matches": 0}, near_misses=[
                NearMiss(self.name, stop, stop, "bisect limit reached (the rewrite is all or nothing)")])
        try:
            new_gm = rebuild(gm, matches, options, self.name)
        except NoMatch as miss:
            node = miss.node.name if miss.node is not None else "graph"
            return PassResult(gm, modified=False, stats={"matches": 0},
                              near_misses=[NearMiss(self.name, matches[0].cat.name, node, miss.reason)])
        spec = new_gm.meta[SPEC_KEY]
        stats = {"matches": len(matches), "caches": len(spec.caches), "max_length": spec.max_length,
                 "attention_ops": len({a for m in matches for a in m.attentions})}
        return PassResult(new_gm, modified=True, stats=stats)


static_kv_cache = StaticKVCache()
__all__ = ["static_kv_cache"]
