"""Getting an optimized FX graph ready for ONNX export: checks, and the one ORT-specific rewrite.

This is the backend's legalisation, not a pass of the pipeline (it knows the runtime):

1. Every graphopt op in the graph must have a translation (``translations/``); the first
   that has none raises ``UnsupportedOp`` naming it. (The target decomposes such ops before
   export, ``partition.py``; this check guards the export entry points against a miss.)
2. ``attention(q, cat(past_k, k, 2), cat(past_v, v, 2))`` -> ``graphopt_ort.gqa_with_past(q,
   k, v, past_k, past_v)``, whose outputs are the attention output and the two
   concatenations (the present cache). That is ONNX Runtime's GroupQueryAttention with
   past/present: the decode step reads the cache once, in the attention kernel, instead of
   a Concat and a separate attention over its result. Preconditions: no mask; causal or a
   single query (then causality changes nothing); one query token or a batch of one (ORT's
   GQA refuses a longer chunk with a past cache for batch > 1); every other user of the
   concatenations comes after the attention (they will read the op's outputs). Each
   attention over a ``cat`` that fails one of these is a near miss with its reason
   (``cached_attention_near_misses``), under the pass name ``ort:gqa_with_past``.

``gqa_with_past`` is a real custom op with a reference implementation (``cat`` + the
reference attention), so the rewritten graph still runs eagerly, which is what a fallback
after this point runs.
"""

from __future__ import annotations

import operator
import sys
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import Tensor

from graphopt import ir
from graphopt.ops import op_name
from graphopt.ops.attention import attention as reference_attention
from graphopt.pass_manager import NearMiss

aten = torch.ops.aten
# The pass name under which this rewrite's refusals appear with the pipeline's near misses.
GQA_WITH_PAST = "ort:gqa_with_past"


@torch.library.custom_op("graphopt_ort::gqa_with_past", mutates_args=())
def gqa_with_past(q: Tensor, k: Tensor, v: Tensor, past_k: Tensor, past_v: Tensor,
                  scale: float | None = None, softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """``attention(q, cat(past_k, k), cat(past_v, v), is_causal=True)`` and the two concatenations.

    q [B, Hq, Sq, D]; k, v [B, Hkv, Sq, D]; past_k, past_v [B, Hkv, P, D]. Causal is
    bottom-right: query i sees the past and new keys up to i.
    """
    key, value = torch.cat((past_k, k), 2), torch.cat((past_v, v), 2)
    return reference_attention(q, key, value, None, scale, True, softcap), key, value


@gqa_with_past.register_fake
def _(q, k, v, past_k, past_v, scale=None, softcap=0.0):
    key, value = torch.cat((past_k, k), 2), torch.cat((past_v, v), 2)
    return q.new_empty((*q.shape[:-1], v.shape[-1])), key, value


def check_translations(gm: fx.GraphModule, table: dict) -> None:
    """Raise UnsupportedOp for the first graphopt op without a translation."""
    from graphopt.backends.onnxruntime.errors import UnsupportedOp
    from graphopt.ops.collectives import COLLECTIVE_OPS

    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = op_name(node.target)
        if name in COLLECTIVE_OPS:  # no translation could help: the fix is another target
            raise UnsupportedOp(name, "it is a collective across tensor-parallel ranks and ONNX Runtime runs no "
                                      "collectives; use target='eager' (or 'triton' on GPUs) for sharded models")
        if name and node.target not in table:
            raise UnsupportedOp(name, "it has no translation; add one under graphopt/backends/onnxruntime/lower/translations/")


def prepare(gm: fx.GraphModule, table: dict) -> tuple[fx.GraphModule, int]:
    """A copy of ``gm`` ready for export, and how many attentions now read a KV cache in GQA."""
    check_translations(gm, table)
    gm = ir.copy_graph_module(gm)
    fused = sum(_fuse_cached_attention(gm, node) for node in list(gm.graph.nodes))
    if fused:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm, fused


def _through_full_slices(node):
    """The tensor behind ``x[:, ...]``-style full slices (``repeat_kv``'s ``x[:, :, None]``
    leaves ``slice(x, 0, 0, INT64_MAX)`` in front of the attention)."""
    while (isinstance(node, fx.Node) and node.target is aten.slice.Tensor and len(node.users) == 1
           and tuple(node.args[2:]) in ((0, sys.maxsize), (0, sys.maxsize, 1), (None, None), ())):
        node = node.args[0]
    return node


def _cache_concat(node) -> tuple[fx.Node, fx.Node] | str | None:
    """(past, new) when ``node`` is ``cat([past, new], 2)`` of two rank-4 tensors; the reason
    when it is another ``cat``; None when it reads no cache (no ``cat``, or an empty one's)."""
    if not isinstance(node, fx.Node) or node.target is not aten.cat.default:
        return None
    tensors = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if len(tensors) != 2:
        return f"{node.name} concatenates {len(tensors)} tensors, not a past cache and the new rows"
    if dim not in (2, -2) or node.meta["val"].dim() != 4:
        return f"{node.name} is not a concatenation along the sequence axis (dim 2) of [B, H, S, D] tensors"
    if any(t.meta["val"].dim() != 4 for t in tensors):
        return None  # transformers' DynamicLayer starts from a 1-D empty tensor: cat([empty, k]) is the prompt's k
    return tensors[0], tensors[1]


@dataclass
class _CachedAttention:
    """An attention GroupQueryAttention with past/present can compute (see the module docstring)."""

    q: fx.Node
    k_cat: fx.Node
    v_cat: fx.Node
    k_parts: tuple[fx.Node, fx.Node]
    v_parts: tuple[fx.Node, fx.Node]
    slices: list[fx.Node]
    scale: object


def _match_cached_attention(gm: fx.GraphModule, node: fx.Node) -> _CachedAttention | NearMiss | None:
    """The match; a NearMiss (pass ``ort:gqa_with_past``) when ``node`` attends over a cache
    concatenation that GQA cannot take; None when it is no attention over a ``cat``."""
    if node.op != "call_function" or node.target is not torch.ops.graphopt.attention.default:
        return None
    args = dict(zip(("q", "k", "v", "mask", "scale", "is_causal", "softcap"), node.args))
    args.update(node.kwargs)
    q, k_cat, v_cat = args["q"], _through_full_slices(args["k"]), _through_full_slices(args["v"])
    k_parts, v_parts = _cache_concat(k_cat), _cache_concat(v_cat)
    if k_parts is None and v_parts is None:
        return None  # no cache read here: the attention lowers without past/present

    def miss(at: fx.Node, reason: str) -> NearMiss:
        return NearMiss(GQA_WITH_PAST, node.name, at.name, reason)

    for parts, cat, which in ((k_parts, k_cat, "k"), (v_parts, v_cat, "v")):
        if parts is None:
            return miss(cat if isinstance(cat, fx.Node) else node, f"{which} is not cat(past, new, dim=2)")
        if isinstance(parts, str):
            return miss(cat, parts)
    if args.get("mask") is not None:
        return miss(args["mask"], "the attention has a mask; GroupQueryAttention with a cache takes none")
    q_shape = q.meta["val"].shape
    one_query = _is(q_shape[2], 1)
    if not (args.get("is_causal", False) or one_query):
        return miss(q, "a non-causal chunk of several queries against the cache is not what GQA computes")
    if not (one_query or _is(q_shape[0], 1)):
        return miss(q, "ORT's GQA needs batch 1 when several queries read a past cache")
    slices = _chain(args["k"], k_cat) + _chain(args["v"], v_cat)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    early = [u for c in (k_cat, v_cat) for u in c.users
             if u is not node and u not in slices and order[u] < order[node]]
    if early:
        return miss(early[0], f"{early[0].name} reads the cache before the attention; it could not read "
                              "the fused op's present output")
    return _CachedAttention(q, k_cat, v_cat, k_parts, v_parts, slices, args.get("scale"))


def cached_attention_near_misses(gm: fx.GraphModule) -> list[NearMiss]:
    """Why each attention over a cache concatenation in ``gm`` will not become GQA with
    past/present (what ``prepare`` would refuse), without changing ``gm``."""
    found = (_match_cached_attention(gm, node) for node in gm.graph.nodes)
    return [m for m in found if isinstance(m, NearMiss)]


def _fuse_cached_attention(gm: fx.GraphModule, node: fx.Node) -> bool:
    match = _match_cached_attention(gm, node)
    if not isinstance(match, _CachedAttention):
        return False
    k_parts, v_parts = match.k_parts, match.v_parts
    with gm.graph.inserting_before(node):
        fused = gm.graph.call_function(torch.ops.graphopt_ort.gqa_with_past.default,
                                       (match.q, k_parts[1], v_parts[1], k_parts[0], v_parts[0], match.scale,
                                        node.args[6] if len(node.args) > 6 else node.kwargs.get("softcap", 0.0)))
        ir.infer_val(fused)
        outs = []
        for i in range(3):
            item = gm.graph.call_function(operator.getitem, (fused, i))
            item.meta["val"] = fused.meta["val"][i]
            outs.append(item)
    node.replace_all_uses_with(outs[0])
    gm.graph.erase_node(node)
    for dead in match.slices:  # each read only by the attention (or the slice after it)
        gm.graph.erase_node(dead)
    match.k_cat.replace_all_uses_with(outs[1])
    match.v_cat.replace_all_uses_with(outs[2])
    return True


def _is(size, value: int) -> bool:
    """``size == value`` only when the size is a plain int (never guard on a symbol)."""
    return isinstance(size, int) and size == value


def _chain(start: fx.Node, stop: fx.Node) -> list[fx.Node]:
    """The full-slice nodes from ``start`` back to (not including) ``stop``, nearest first."""
    nodes = []
    while start is not stop:
        nodes.append(start)
        start = start.args[0]
    return nodes
