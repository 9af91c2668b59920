"""Rotary embedding into the cache write: ``q' = rope(q); kv_cache_update(k_cache, rope(k), pos);
kv_cache_update(v_cache, v, pos)  ->  q' = graphopt.rope_kv_cache_update(q, k, v, cos, sin, k_cache, v_cache, pos)``.

Why: after ``static_kv_cache`` every attention layer of a decode step runs two rotations and
two cache writes between its projections and its attention: four kernel launches per layer
on the triton target (a third of a small Llama's step), and the rotated keys make a round
trip through memory on their way to the cache. The fused op is one launch
(backends/triton/kernels/rope_cache.py). Eager runs the op's reference: the same four steps.

Anchored on each ``graphopt.cache_attention(q', k_cache, v_cache, ...)`` (static_kv_cache's
reader of a static cache). Preconditions, each a near miss when it fails:
- ``q'`` is ``graphopt.rope(q, cos, sin, interleaved)``;
- exactly one ``kv_cache_update`` writes each cache, with the same position, in layout
  bhsd or bshd, without a block table or int8 scales (the paged and int8 writes keep their op);
- the key cache receives ``rope(k)`` with the same tables and pairing as q's, used by nothing else
  (directly, or through permutes and clones that move no element, as a prompt chunk has them);
- the rotated keys are in the cache's dtype or fp32 (one rounding on the way in, as the
  kernel does it); value and key heads have one head size;
- the fused op can sit where the first write was: its inputs are defined before it, every
  reader of ``q'`` comes after it, and nothing between the two writes touches either cache.
Runs after ``static_kv_cache`` (which makes the writes) and before ``cuda_graphs`` (which
must see the final ops); graphopt.generation.static runs the three in that order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.pass_manager import NearMiss, NoOptions, PassContext, PassResult
from graphopt.rewrite import NoMatch, expect, is_op, val

aten, g = torch.ops.aten, torch.ops.graphopt
ROPE, WRITE, READ = g.rope.default, g.kv_cache_update.default, g.cache_attention.default
FUSED = g.rope_kv_cache_update.default
LAYOUTS = ("bhsd", "bshd")


@dataclass
class LayerMatch:
    q_rope: fx.Node
    k_rope: fx.Node
    k_copies: list[fx.Node]  # layout-only nodes between the rotated keys and their write
    k_write: fx.Node
    v_write: fx.Node


def _arg(node: fx.Node, index: int, name: str, default=None):
    """An op call's argument by position or keyword (fx keeps whichever the caller used)."""
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _rope_parts(node: fx.Node) -> tuple:
    """(x, cos, sin, interleaved) of a graphopt.rope call."""
    return node.args[0], node.args[1], node.args[2], bool(_arg(node, 3, "interleaved", False))


def through_layout_copies(node: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """``(source, copies)``: ``node`` seen through a chain of single-use permutes, transposes
    and clones that together move no element (fuse_rope leaves such a chain around a rotation
    of [B, S, H, D] tokens); ``(node, [])`` when the chain is not the identity."""
    copies, dims = [], [0, 1, 2, 3]  # dims[i]: the source dim that the value's dim i reads
    source = node
    while len(source.users) == 1 and is_op(source, aten.permute.default, aten.transpose.int, aten.clone.default):
        if is_op(source, aten.permute.default):
            dims = [source.args[1][i] % 4 for i in dims]
        elif is_op(source, aten.transpose.int):
            a, b = source.args[1] % 4, source.args[2] % 4
            swap = {a: b, b: a}
            dims = [swap.get(d, d) for d in dims]
        copies.append(source)
        source = source.args[0]
    return (source, copies) if dims == [0, 1, 2, 3] and copies else (node, [])


def _the_write(cache: fx.Node, what: str, read: fx.Node) -> fx.Node:
    writes = [u for u in cache.users if is_op(u, WRITE) and u.args[0] is cache]
    expect(len(writes) == 1, f"the {what} cache is written by {len(writes)} kv_cache_update ops, not one", read)
    write = writes[0]
    layout = _arg(write, 3, "layout", "bhsd")
    expect(layout in LAYOUTS, f"the {what} cache is {layout}: only bhsd and bshd writes fuse", write)
    expect(_arg(write, 4, "block_table") is None, f"the {what} cache is paged (a block table)", write)
    expect(_arg(write, 5, "scales") is None, f"the {what} cache is int8 (it quantizes on the way in)", write)
    return write


def match_layer(read: fx.Node, order: dict[fx.Node, int]) -> LayerMatch:
    """The rotations and writes that feed one cache_attention, or NoMatch saying why not."""
    q_rope, k_cache, v_cache = read.args[0], read.args[1], read.args[2]
    expect(is_op(q_rope, ROPE), "the query reaches attention without a graphopt.rope", read)
    k_write, v_write = _the_write(k_cache, "key", read), _the_write(v_cache, "value", read)
    expect(k_write.args[2] is v_write.args[2], "the key and value writes use different positions", v_write)
    expect(_arg(k_write, 3, "layout", "bhsd") == _arg(v_write, 3, "layout", "bhsd"),
           "the key and value caches have different layouts", v_write)
    k_rope, k_copies = through_layout_copies(k_write.args[1])
    expect(is_op(k_rope, ROPE), "the key cache is written without a graphopt.rope of the keys", k_write)
    expect(len(k_rope.users) == 1, "the rotated keys have another reader than the cache write", k_rope)
    _, q_cos, q_sin, q_pairs = _rope_parts(q_rope)
    k, k_cos, k_sin, k_pairs = _rope_parts(k_rope)
    expect((k_cos, k_sin, k_pairs) == (q_cos, q_sin, q_pairs), "q and k rotate with different tables", k_rope)
    rotated, cache = val(k_rope).dtype, val(k_cache).dtype
    expect(rotated in (cache, torch.float32), f"rotated keys in {rotated} for a {cache} cache would round twice",
           k_rope)
    expect(val(v_write.args[1]).shape[-1] == val(k).shape[-1], "value and key heads differ in size", v_write)
    first, last = sorted((k_write, v_write), key=order.__getitem__)
    inputs = [q_rope.args[0], k, v_write.args[1], q_cos, q_sin, k_cache, v_cache, k_write.args[2]]
    late = [n.name for n in inputs if isinstance(n, fx.Node) and order[n] > order[first]]
    expect(not late, f"{', '.join(late)} is computed after the first cache write", first)
    early = [u.name for u in q_rope.users if order[u] < order[first]]
    expect(not early, f"{', '.join(early)} reads the rotated query before the cache writes", q_rope)
    between = [n.name for n in (*k_cache.users, *v_cache.users)
               if n not in (k_write, v_write) and order[first] < order[n] < order[last]]
    expect(not between, f"{', '.join(between)} touches a cache between its two writes", last)
    return LayerMatch(q_rope, k_rope, k_copies, k_write, v_write)


def rewrite(gm: fx.GraphModule, match: LayerMatch, order: dict[fx.Node, int], pass_name: str) -> None:
    q, cos, sin, interleaved = _rope_parts(match.q_rope)
    first = min(match.k_write, match.v_write, key=order.__getitem__)
    args = (q, match.k_rope.args[0], match.v_write.args[1], cos, sin, match.k_write.args[0],
            match.v_write.args[0], match.k_write.args[2], _arg(match.k_write, 3, "layout", "bhsd"), interleaved)
    with gm.graph.inserting_before(first):
        fused = gm.graph.call_function(FUSED, args)
    fused.meta.update(match.q_rope.meta)  # the rotated query's val and provenance
    fused.meta[ir.CREATED_BY] = pass_name
    match.q_rope.replace_all_uses_with(fused)
    for node in (match.k_write, match.v_write, *match.k_copies, match.k_rope, match.q_rope):
        gm.graph.erase_node(node)


class FuseRopeKvCacheUpdate:
    name = "fuse_rope_kv_cache_update"
    summary = "fold a static-cache layer's rope(q), rope(k) and K/V cache writes into one op"
    Options = NoOptions
    requires: tuple[str, ...] = ("static_kv_cache",)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        reads = [n for n in gm.graph.nodes if is_op(n, READ)]
        if not reads:
            miss = NearMiss(self.name, "graph", "graph", "no graphopt.cache_attention: static_kv_cache did not "
                            "rewrite this graph (it runs for graphopt.generate's steps only)")
            return PassResult(gm, modified=False, stats={"matches": 0}, near_misses=[miss])
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        matches, misses, claimed = [], [], set()
        for read in reads:
            try:
                match = match_layer(read, order)
                expect(not {match.k_write, match.v_write} & claimed, "another attention reads the same caches", read)
            except NoMatch as miss:
                misses.append(NearMiss(self.name, read.name, (miss.node or read).name, miss.reason))
                continue
            claimed |= {match.k_write, match.v_write}
            if ctx.allow_rewrite(self.name, read):
                matches.append(match)
        for match in matches:
            rewrite(gm, match, order, self.name)
        if matches:
            gm.graph.lint()
            gm.recompile()
        return PassResult(gm, modified=bool(matches), stats={"matches": len(matches)}, near_misses=misses)


fuse_rope_kv_cache_update = FuseRopeKvCacheUpdate()
