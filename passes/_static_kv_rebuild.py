"""The graph surgery behind ``static_kv_cache``: copy the graph node by node into one with
static shapes, a position input and in-place cache updates.

Why a copy rather than edits in place: every node downstream of the past length changes
its shape (S_past + S_new becomes max_length), so each needs a new ``meta["val"]`` from a
static FakeTensorMode anyway, and a node whose size arguments mention the past length
needs new arguments. The past length P (one symbol per past input, all the same length)
is carried as an affine form ``a * P + c`` instead of graph nodes, and resolved where it
is used: in a size it must be a multiple of the key length P + S_new and becomes the same
multiple of max_length; as a value added to a tensor (a query position) it becomes ``pos``.
Anything else raises NoMatch with the node and the reason.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from graphopt import ir
from graphopt.ops.kv_cache import SPEC_KEY, CacheInput, StaticCacheSpec, cache_shape
from graphopt.passes._static_kv_types import CACHE_INPUT, CacheMatch, Options
from graphopt.rewrite import BATCHED_MATMUL_OPS, SIZE_ASSERT_OPS, SIZE_OPS, NoMatch, expect, is_op, val

aten = torch.ops.aten
kv_cache_update = torch.ops.graphopt.kv_cache_update.default
cache_attention = torch.ops.graphopt.cache_attention.default

_META_DROPPED = ("val", "tensor_meta", "unbacked_bindings", "example_value")
_DROP = object()  # a value the rewritten graph no longer has (runtime asserts on the past length)


@dataclass(frozen=True)
class Affine:
    """``a * P + c``: a size or position that depended on the past length P."""

    a: int
    c: int


class Rebuilder:
    def __init__(self, gm: fx.GraphModule, matches: list[CacheMatch], options: Options, pass_name: str):
        self.gm, self.options, self.pass_name = gm, options, pass_name
        self.by_cat = {m.cat: m for m in matches}
        self.by_past = {m.past: m for m in matches}
        self.chain = {n for m in matches for n in m.chain}
        self.attentions = {a for m in matches for a in m.attentions if not is_op(a, *BATCHED_MATMUL_OPS)}
        self.softmaxes = {s for m in matches for s in m.softmaxes}
        lengths = {val(m.new).shape[2] for m in matches}
        expect(len(lengths) == 1, f"caches grow by different lengths {sorted(lengths)}", matches[0].cat)
        self.new_len = lengths.pop()
        self.max_len = options.effective_length()
        expect(self.max_len >= self.new_len, f"max_length {self.max_len} is shorter than one step ({self.new_len})")
        self.symbols = {val(m.past).shape[2].node.expr for m in matches}
        self.P = sympy.Symbol("P", integer=True)
        self.graph = fx.Graph()
        self.env: dict[fx.Node, Any] = {}
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.masks: dict[Any, fx.Node] = {}
        first = val(matches[0].past)
        self.device, self.batch = first.device, first.shape[0]

    # ------------------------------------------------------------ emitting nodes
    def call(self, target, args, kwargs=None, like: fx.Node | None = None) -> fx.Node:
        # Unchanged ops keep their names, so --print-ir-after static_kv_cache diffs line up.
        name = like.name if like is not None and like.target is target else None
        node = self.graph.create_node("call_function", target, tuple(args), kwargs or {}, name=name)
        if like is not None:
            node.meta.update({k: v for k, v in like.meta.items() if k not in _META_DROPPED})
        if like is None or node.target is not like.target:
            node.meta[ir.CREATED_BY] = self.pass_name
        args_v, kwargs_v = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
        try:
            with self.fake:
                node.meta["val"] = target(*args_v, **kwargs_v)
        except Exception as error:  # a shape that only made sense with the dynamic length
            raise NoMatch(f"{ir.target_name(target)} fails on static shapes: {type(error).__name__}: "
                          f"{str(error).splitlines()[0] if str(error) else ''}", like) from error
        return node

    def placeholder(self, name: str, shape, dtype, like: fx.Node | None = None) -> fx.Node:
        node = self.graph.placeholder(name)
        device = val(like).device if like is not None else self.device
        if like is not None:
            node.meta.update({k: v for k, v in like.meta.items() if k not in _META_DROPPED})
        with self.fake:
            node.meta["val"] = torch.empty(shape, dtype=dtype, device=device)
        return node

    # ------------------------------------------------------------ the past length
    def affine(self, node: fx.Node) -> Affine:
        expr = sympy.expand(sympy.sympify(val(node).node.expr).subs({s: self.P for s in self.symbols}))
        extra = expr.free_symbols - {self.P}
        expect(not extra, f"{node.name} = {val(node)} depends on a dynamic size other than the past length", node)
        poly = sympy.Poly(expr, self.P)
        expect(poly.degree() <= 1, f"{node.name} = {expr} is not linear in the past length", node)
        a, c = (int(poly.coeff_monomial(self.P)), int(poly.coeff_monomial(1)))
        return Affine(a, c)

    def as_size(self, value: Affine, node: fx.Node) -> int:
        # A size of the key axis is P + S_new; flattened with heads it is a multiple of that.
        expect(value.a > 0 and value.c == value.a * self.new_len,
               f"{node.name} uses {value.a}*P+{value.c} as a size; only multiples of the key length "
               f"P+{self.new_len} can become max_length", node)
        return value.a * self.max_len

    def resolve(self, old: fx.Node, args: tuple, kwargs: dict) -> fx.Node:
        """Emit ``old`` with its past-length arguments re-expressed."""
        flat = _leaves((args, kwargs))
        if any(x is _DROP for x in flat):
            raise NoMatch(f"{old.name} reads a runtime check on the past length", old)
        if not any(isinstance(x, Affine) for x in flat):
            return self.call(old.target, args, kwargs, like=old)
        target = old.target
        if target in SIZE_OPS:
            sized = _map_affine((args, kwargs), lambda x: self.as_size(x, old))
            return self.call(target, sized[0], sized[1], like=old)
        if target is aten.slice.Tensor:
            expect(not isinstance(args[2] if len(args) > 2 else None, Affine),
                   f"{old.name} slices from an offset that depends on the past length", old)
            sized = _map_affine((args, kwargs), lambda x: self.as_size(x, old))
            return self.call(target, sized[0], sized[1], like=old)
        if target in (aten.arange.start, aten.arange.start_step):
            start, end = args[0], args[1]
            if isinstance(start, Affine) and isinstance(end, Affine) and start.a == end.a == 1:
                # Positions P + c1 .. P + c2: arange(c1, c2) + pos.
                rng = self.call(target, (start.c, end.c, *args[2:]), kwargs, like=old)
                return self.call(aten.add.Tensor, (rng, self.pos), like=old)
            expect(not isinstance(start, Affine), f"{old.name} starts a range at the past length but its "
                   "length is not constant", old)
            return self.call(target, (start, self.as_size(end, old), *args[2:]), kwargs, like=old)
        if target in (aten.add.Tensor, aten.sub.Tensor) and isinstance(args[1], Affine) \
                and isinstance(args[0], fx.Node):
            value = args[1]
            expect(value.a == 1, f"{old.name} uses {value.a}*P as a value; only P itself becomes pos", old)
            base = self.call(target, (args[0], value.c, *args[2:]), kwargs, like=old) if value.c else args[0]
            return self.call(target, (base, self.pos), kwargs, like=old)
        raise NoMatch(f"{old.name} ({ir.target_name(target)}) uses the past length in a way static_kv_cache "
                      "cannot re-express (only sizes of the key axis and added positions)", old)

    # ------------------------------------------------------------ caches and masks
    def emit_update_and_read(self, match: CacheMatch) -> fx.Node:
        slot = self.slots[match.past]
        cache, scales = slot["cache"], slot.get("scales")
        layout = self.options.layout
        self.call(kv_cache_update, (cache, self.env[match.new], self.pos, layout, self.block_table, scales))
        dtype = val(match.cat).dtype
        read = self.read(cache, match.cat)
        if scales is None:
            self.reads[read] = slot
            return read
        q = self.call(aten._to_copy.default, (read,), {"dtype": torch.float32}, like=match.cat)
        s = self.call(aten._to_copy.default, (self.read(scales, match.cat),), {"dtype": torch.float32}, like=match.cat)
        deq = self.call(aten.mul.Tensor, (q, s), like=match.cat)
        out = deq if dtype == torch.float32 else self.call(aten._to_copy.default, (deq,), {"dtype": dtype},
                                                          like=match.cat)
        self.reads[out] = slot  # an attention reading it directly reads the int8 bytes instead (dead then)
        return out

    def read(self, buffer: fx.Node, like: fx.Node) -> fx.Node:
        """[B, H, max_length, D] view (or gather) of ``buffer``, as ops.kv_cache.read_cache."""
        layout = self.options.layout
        if layout == "bhsd":
            return buffer
        if layout == "bshd":
            return self.call(aten.transpose.int, (buffer, 1, 2), like=like)
        table = self.block_table
        if val(table).dtype != torch.long:
            table = self.call(aten._to_copy.default, (table,), {"dtype": torch.long}, like=like)
        gathered = self.call(aten.index.Tensor, (buffer, [table]), like=like)
        b, n, h, blk, d = val(gathered).shape
        perm = self.call(aten.permute.default, (gathered, [0, 2, 1, 3, 4]), like=like)
        return self.call(aten.reshape.default, (perm, [b, h, n * blk, d]), like=like)

    def mask(self, kind: str, dtype: torch.dtype | None = None) -> fx.Node:
        """Shared mask nodes over the static key axis: 'valid' (j < pos + S_new, [1, 1, 1, L]),
        'causal' (j <= pos + i, [1, 1, S_new, L]), 'additive' (0 / -inf of valid, in dtype),
        'invalid_1d' (not valid, [L])."""
        key = (kind, dtype)
        if key in self.masks:
            return self.masks[key]
        kv_idx = self.masks.get("kv_idx")
        if kv_idx is None:
            kv_idx = self.call(aten.arange.default, (self.max_len,), {"device": self.device, "dtype": torch.long})
            kv_idx = self.masks["kv_idx"] = self.call(aten.view.default, (kv_idx, [1, 1, 1, self.max_len]))
        if kind == "valid":
            limit = self.call(aten.add.Tensor, (self.pos, self.new_len))
            node = self.call(aten.lt.Tensor, (kv_idx, limit))
        elif kind == "invalid_1d":  # [L]: broadcasts into scores of any rank (bmm's [B*H, S, L])
            node = self.call(aten.view.default, (self.call(aten.logical_not.default, (self.mask("valid"),)),
                                                 [self.max_len]))
        elif kind == "causal":
            rows = self.call(aten.arange.default, (self.new_len,), {"device": self.device, "dtype": torch.long})
            rows = self.call(aten.view.default, (self.call(aten.add.Tensor, (rows, self.pos)),
                                                 [1, 1, self.new_len, 1]))
            node = self.call(aten.le.Tensor, (kv_idx, rows))
        else:
            zeros = self.call(aten.zeros.default, ([1, 1, 1, self.max_len],), {"dtype": dtype, "device": self.device})
            invalid = self.call(aten.logical_not.default, (self.mask("valid"),))
            node = self.call(aten.masked_fill.Scalar, (zeros, invalid, float("-inf")))
        self.masks[key] = node
        return node

    def emit_attention(self, old: fx.Node, args: tuple, kwargs: dict) -> Any:
        names = [a.name for a in old.target._schema.arguments]
        bound = {**{a.name: a.default_value for a in old.target._schema.arguments if a.has_default_value()},
                 **dict(zip(names, args)), **kwargs}
        is_graphopt = "q" in bound
        mask = bound.get("mask" if is_graphopt else "attn_mask")
        causal = bool(bound.get("is_causal", False))
        expect(is_graphopt or not causal, "SDPA is_causal over a cache aligns top-left, which is wrong once "
               "keys outnumber queries; not rewritten", old)
        bounded = self.bounded_attention(old, bound, is_graphopt, mask, causal)
        if bounded is not None:
            return bounded
        extra = self.mask("causal") if causal else self.mask("valid")
        if mask is None:
            mask = extra
        elif val(mask).dtype == torch.bool:
            mask = self.call(aten.logical_and.default, (mask, extra), like=old)
        else:
            expect(not causal, "graphopt.attention is_causal together with an additive mask", old)
            additive = self.mask("additive", val(mask).dtype)
            mask = self.call(aten.add.Tensor, (mask, additive), like=old)
        if is_graphopt:
            return self.call(old.target, (bound["q"], bound["k"], bound["v"], mask, bound.get("scale"), False,
                                          bound.get("softcap", 0.0)), like=old)
        dropout = bound.get("dropout_p", 0.0)
        expect(dropout == 0.0, f"dropout_p {dropout}", old)
        sdpa = self.call(aten.scaled_dot_product_attention.default,
                         (bound["query"], bound["key"], bound["value"], mask, 0.0, False),
                         {"scale": bound.get("scale"), **({"enable_gqa": True} if bound.get("enable_gqa") else {})},
                         like=old)
        return sdpa if old.target is aten.scaled_dot_product_attention.default else [sdpa]

    def lengths(self) -> fx.Node:
        """[B] valid lengths, pos + S_new for every row: a device tensor, so one graph serves every step."""
        if "lengths" not in self.masks:
            end = self.call(aten.add.Tensor, (self.pos, self.new_len))
            self.masks["lengths"] = self.call(aten.expand.default, (end, [self.batch]))
        return self.masks["lengths"]

    def bounded_attention(self, old: fx.Node, bound: dict, is_graphopt: bool, mask: Any, causal: bool) -> Any:
        """``graphopt.cache_attention`` on the raw buffers when k and v are two whole cache reads;
        None (the masked full-length form) when they pass through other views first."""
        k, v = (bound["k"], bound["v"]) if is_graphopt else (bound["key"], bound["value"])
        slot_k, slot_v = self.reads.get(k), self.reads.get(v)
        if slot_k is None or slot_v is None:
            return None
        if not is_graphopt:
            heads_q, heads_kv = val(bound["query"]).shape[1], val(k).shape[1]
            if bound.get("dropout_p", 0.0) != 0.0 or heads_q != heads_kv and not bound.get("enable_gqa"):
                return None  # SDPA itself would refuse these heads; keep its own error
        q = bound["q"] if is_graphopt else bound["query"]
        scale = bound.get("scale")
        softcap = bound.get("softcap", 0.0) if is_graphopt else 0.0
        out = self.call(cache_attention, (q, slot_k["cache"], slot_v["cache"], self.lengths(), self.options.layout,
                                          self.block_table, slot_k.get("scales"), slot_v.get("scales"), mask, scale,
                                          causal, softcap), like=old)
        return out if is_graphopt or old.target is aten.scaled_dot_product_attention.default else [out]

    # ------------------------------------------------------------ the walk
    def run(self) -> fx.GraphModule:
        old_nodes = list(self.gm.graph.nodes)
        self.slots: dict[fx.Node, dict] = {}
        self.reads: dict[fx.Node, dict] = {}  # a whole-cache read ([B, H, max_length, D]) -> its slot
        spec = StaticCacheSpec(self.options.layout, self.max_len, self.options.block_size, self.options.kv_dtype,
                               self.new_len, self.batch, self.device)
        placeholders = [n for n in old_nodes if n.op == "placeholder"]
        int8 = self.options.kv_dtype == "int8"
        for node in placeholders:
            v = val(node)
            if node in self.by_past:
                b, h, _, d = v.shape
                shape = cache_shape(self.options.layout, b, h, self.max_len, d, self.options.block_size)
                dtype = torch.int8 if int8 else v.dtype
                cache = self.placeholder(f"{node.name}_cache", shape, dtype, like=node)
                cache.meta[CACHE_INPUT] = len(spec.caches)
                self.slots[node] = {"cache": cache}
                spec.caches.append(CacheInput(node.name, len(self.graph.nodes) - 1, shape, dtype))
                continue
            expect(not isinstance(v, torch.Tensor) or all(isinstance(s, int) for s in v.shape),
                   f"input {node.name} {ir.describe_val(v)} has a dynamic shape", node)
            self.env[node] = self.placeholder(node.name, v.shape, v.dtype, like=node) \
                if isinstance(v, torch.Tensor) else self.graph.placeholder(node.name)
        spec.pos_index = len(placeholders)
        self.pos = self.placeholder("cache_position", (), torch.long)
        self.block_table = None
        if self.options.layout == "paged":
            per_seq = self.max_len // self.options.block_size
            spec.block_table_index, spec.block_table_shape = spec.pos_index + 1, (self.batch, per_seq)
            self.block_table = self.placeholder("block_table", spec.block_table_shape, torch.long)
        if int8:
            index = len([n for n in self.graph.nodes if n.op == "placeholder"])
            for slot, entry in zip(self.slots.values(), spec.caches):
                shape = (*entry.shape[:3], 1)
                slot["scales"] = self.placeholder(f"{slot['cache'].name}_scales", shape, torch.float32)
                entry.scales_index, entry.scales_shape, index = index, shape, index + 1
        for old in old_nodes:
            if old.op == "placeholder":
                continue
            if old.op == "get_attr":
                new = self.graph.get_attr(old.target)
                new.meta.update({k: v for k, v in old.meta.items() if k not in _META_DROPPED})
                const = ir.get_constant(old)
                new.meta["val"] = self.fake.from_tensor(const, static_shapes=True) if const is not None else val(old)
                self.env[old] = new
            elif old.op == "output":
                self.emit_output(old, spec)
            elif old in self.chain or old in self.by_past:
                continue
            elif old in self.by_cat:
                self.env[old] = self.emit_update_and_read(self.by_cat[old])
            elif old.target in SIZE_ASSERT_OPS or isinstance(val(old), (torch.SymBool, torch.SymFloat)):
                self.env[old] = _DROP
            elif isinstance(val(old), torch.SymInt):
                self.env[old] = self.affine(old)
            else:
                args, kwargs = fx.node.map_arg((old.args, old.kwargs), lambda n: self.env[n])
                if old.target is operator.getitem and isinstance(args[0], list):
                    self.env[old] = args[0][args[1]]  # output 0 of a replaced SDPA variant
                elif old in self.attentions:
                    self.env[old] = self.emit_attention(old, args, kwargs)
                elif old in self.softmaxes:  # explicit attention: mask the unwritten tail first
                    masked = self.call(aten.masked_fill.Scalar, (args[0], self.mask("invalid_1d"), float("-inf")),
                                       like=old)
                    self.env[old] = self.resolve(old, (masked, *args[1:]), kwargs)
                else:
                    self.env[old] = self.resolve(old, args, kwargs)
        new_gm = fx.GraphModule(self.gm, self.graph)
        new_gm.meta.update(getattr(self.gm, "meta", {}))
        new_gm.meta[SPEC_KEY] = spec
        new_gm.graph.eliminate_dead_code()  # the masks and sizes that served only the dynamic length
        new_gm.recompile()
        return new_gm

    def emit_output(self, old: fx.Node, spec: StaticCacheSpec) -> None:
        outs = old.args[0]
        single = not isinstance(outs, (list, tuple))
        kept = []
        for i, out in enumerate([outs] if single else outs):
            if out in self.by_cat:
                spec.dropped_outputs.append(i)  # the caller owns the cache; no output aliases it
                continue
            value = self.env[out] if isinstance(out, fx.Node) else out
            expect(isinstance(value, fx.Node) or not isinstance(value, (Affine, torch.SymInt)) and value is not _DROP,
                   f"output {i} depends on the past length", old)
            kept.append(value)
        self.graph.output(kept[0] if single and kept else (type(outs)(kept) if not single else tuple(kept)))


def _leaves(tree: Any) -> list:
    out: list = []
    fx.node.map_aggregate(tree, lambda x: out.append(x) or x)
    return out


def _map_affine(tree: Any, fn) -> Any:
    return fx.node.map_aggregate(tree, lambda x: fn(x) if isinstance(x, Affine) else x)


def rebuild(gm: fx.GraphModule, matches: list[CacheMatch], options: Options, pass_name: str) -> fx.GraphModule:
    """The static-cache graph for ``matches`` (all of the graph's cache cats); NoMatch says why not."""
    return Rebuilder(gm, matches, options, pass_name).run()


__all__ = ["rebuild", "Affine"]
