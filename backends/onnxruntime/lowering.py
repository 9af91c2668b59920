"""Getting an optimized FX graph ready for ONNX export: checks, and the one ORT-specific rewrite.

This is the backend's legalisation, not a pass of the pipeline (it knows the runtime):

1. Every graphopt op in the graph must have a translation (``translations/``); the first
   that has none raises ``UnsupportedOp`` naming it, so the target falls back to eager with
   a warning that says which op.
2. ``attention(q, cat(past_k, k, 2), cat(past_v, v, 2))`` -> ``graphopt_ort.gqa_with_past(q,
   k, v, past_k, past_v)``, whose outputs are the attention output and the two
   concatenations (the present cache). That is ONNX Runtime's GroupQueryAttention with
   past/present: the decode step reads the cache once, in the attention kernel, instead of
   a Concat and a separate attention over its result. Preconditions: no mask; causal or a
   single query (then causality changes nothing); one query token or a batch of one (ORT's
   GQA refuses a longer chunk with a past cache for batch > 1); every other user of the
   concatenations comes after the attention (they will read the op's outputs).

``gqa_with_past`` is a real custom op with a reference implementation (``cat`` + the
reference attention), so the rewritten graph still runs eagerly, which is what a fallback
after this point runs.
"""

from __future__ import annotations

import operator
import sys

import torch
import torch.fx as fx
from torch import Tensor

from graphopt import ir
from graphopt.ops import op_name
from graphopt.ops.attention import attention as reference_attention

aten = torch.ops.aten


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

    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = op_name(node.target)
        if name and node.target not in table:
            raise UnsupportedOp(name, "it has no translation; add one under graphopt/backends/onnxruntime/translations/")


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


def _cache_concat(node) -> tuple[fx.Node, fx.Node] | None:
    """(past, new) when ``node`` is ``cat([past, new], 2)`` of two rank-4 tensors."""
    if not isinstance(node, fx.Node) or node.target is not aten.cat.default:
        return None
    tensors = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if len(tensors) != 2 or dim not in (2, -2) or node.meta["val"].dim() != 4:
        return None
    if any(t.meta["val"].dim() != 4 for t in tensors):
        return None  # transformers' DynamicLayer starts from a 1-D empty tensor: cat([empty, k]) is the prompt's k
    return tensors[0], tensors[1]


def _fuse_cached_attention(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op != "call_function" or node.target is not torch.ops.graphopt.attention.default:
        return False
    args = dict(zip(("q", "k", "v", "mask", "scale", "is_causal", "softcap"), node.args))
    args.update(node.kwargs)
    q, k_cat, v_cat = args["q"], _through_full_slices(args["k"]), _through_full_slices(args["v"])
    k_parts, v_parts = _cache_concat(k_cat), _cache_concat(v_cat)
    if k_parts is None or v_parts is None or args.get("mask") is not None:
        return False
    q_shape = q.meta["val"].shape
    one_query = _is(q_shape[2], 1)
    if not (args.get("is_causal", False) or one_query):
        return False  # a non-causal chunk against the cache is not what GQA computes
    if not (one_query or _is(q_shape[0], 1)):
        return False  # ORT: "batch_size must be 1 when sequence_length > 1 and past context is given"
    slices = _chain(args["k"], k_cat) + _chain(args["v"], v_cat)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    later_users = [u for c in (k_cat, v_cat) for u in c.users if u is not node and u not in slices]
    if any(order[u] < order[node] for u in later_users):
        return False  # a user of the cache before the attention could not read the op's output
    with gm.graph.inserting_before(node):
        fused = gm.graph.call_function(torch.ops.graphopt_ort.gqa_with_past.default,
                                       (q, k_parts[1], v_parts[1], k_parts[0], v_parts[0], args.get("scale"),
                                        args.get("softcap", 0.0)))
        ir.infer_val(fused)
        outs = []
        for i in range(3):
            item = gm.graph.call_function(operator.getitem, (fused, i))
            item.meta["val"] = fused.meta["val"][i]
            outs.append(item)
    node.replace_all_uses_with(outs[0])
    gm.graph.erase_node(node)
    for dead in slices:  # each read only by the attention (or the slice after it)
        gm.graph.erase_node(dead)
    k_cat.replace_all_uses_with(outs[1])
    v_cat.replace_all_uses_with(outs[2])
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
