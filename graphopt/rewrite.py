"""The pattern-rewrite pass base and the small matchers fusion passes are built from.

A fusion pass names its anchor ops (where a match starts, usually the last op of the
pattern), a ``match`` that walks backwards from an anchor and raises :class:`NoMatch`
with a reason at the node where the pattern stops, and a ``rewrite`` that inserts the
fused op. The base class does the rest: counting, near-miss records for
``graphopt debug --why``, the bisect limit, stamping new nodes and giving them
``meta["val"]``, dead-code elimination.
"""

from __future__ import annotations

import numbers
from typing import Any, ClassVar, Iterable

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.pass_manager import NearMiss, NoOptions, PassContext, PassResult

aten = torch.ops.aten

# Every ATen spelling of scaled_dot_product_attention a captured graph can hold (the plain
# op, and the backend-specific ops it decomposes to), for passes that anchor on attention.
SDPA_OPS = (
    aten.scaled_dot_product_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
)

# Node metadata a rewrite carries from the node it replaces to the nodes it creates.
_INHERITED_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "seq_nr")


class NoMatch(Exception):
    """Raised by a matcher: ``reason`` says why, ``node`` where matching stopped."""

    def __init__(self, reason: str, node: fx.Node | None = None):
        super().__init__(reason)
        self.reason = reason
        self.node = node


def expect(condition: bool, reason: str, node: Any = None) -> None:
    """Guard clause for matchers: raise NoMatch(reason) unless ``condition``."""
    if not condition:
        raise NoMatch(reason, node if isinstance(node, fx.Node) else None)


def is_op(node: Any, *targets: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def expect_op(node: Any, targets: Iterable[Any] | Any, what: str) -> fx.Node:
    """``node`` must call one of ``targets``; ``what`` names the role in the reason."""
    targets = tuple(targets) if isinstance(targets, (tuple, list, set)) else (targets,)
    if not is_op(node, *targets):
        found = ir.target_name(node.target) if isinstance(node, fx.Node) else repr(node)
        expected = " or ".join(ir.target_name(t) for t in targets)
        raise NoMatch(f"{what}: expected {expected}, found {found}", node if isinstance(node, fx.Node) else None)
    return node


def only_user(node: fx.Node, what: str) -> fx.Node:
    """The single user of ``node``; fusing away a value another node reads would lose it."""
    expect(len(node.users) == 1, f"{what} {node.name} has {len(node.users)} users, expected 1", node)
    return next(iter(node.users))


def single_use(node: fx.Node, what: str) -> fx.Node:
    """Check ``node`` is read once (it will be fused away) and return it."""
    expect(len(node.users) == 1, f"{what} {node.name} has {len(node.users)} users; a fusion would lose the others", node)
    return node


def scalar(value: Any) -> float | None:
    """A Python number for a literal, or a 0-d constant / scalar_tensor node; else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Number):
        return float(value)
    if is_op(value, aten.scalar_tensor.default) and isinstance(value.args[0], numbers.Number):
        return float(value.args[0])
    if is_op(value, aten.lift_fresh_copy.default):
        value = value.args[0]
    const = ir.get_constant(value)
    if const is not None and const.numel() == 1:
        return float(const.item())
    return None


CAST_OPS = (aten._to_copy.default, torch.ops.prims.convert_element_type.default)

FLOAT_BITS = {torch.float16: 16, torch.bfloat16: 16, torch.float32: 32, torch.float64: 64}


def is_cast(node: Any) -> bool:
    """A dtype cast that changes nothing else: ``prims.convert_element_type``, or
    ``_to_copy(x, dtype=...)`` possibly with ``layout=strided`` and x's own device (the
    form ``type_as`` and ``softmax(dtype=...)`` lower to)."""
    if not is_op(node, *CAST_OPS):
        return False
    if node.target is not aten._to_copy.default:
        return True
    if len(node.args) != 1 or not set(node.kwargs) <= {"dtype", "layout", "device"}:
        return False
    if set(node.kwargs) <= {"dtype"}:
        return True
    src, out = val(node.args[0]), val(node)
    return (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)
            and node.kwargs.get("layout", torch.strided) == torch.strided
            and src.layout == torch.strided and src.device == out.device)


def strip_casts(node: Any) -> Any:
    """Walk up through dtype casts: ``x.float().to(fp16)`` matches as ``x``."""
    while is_cast(node):
        node = node.args[0]
    return node


def val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def last_dim(node: fx.Node) -> int | None:
    v = val(node)
    return v.dim() - 1 if isinstance(v, torch.Tensor) else None


def is_last_dim(dims: Any, node: fx.Node) -> bool:
    """``dims`` (an int or a one-element list) names the last axis of ``node``'s value."""
    if isinstance(dims, (list, tuple)):
        if len(dims) != 1:
            return False
        dims = dims[0]
    rank = last_dim(node)
    return isinstance(dims, int) and rank is not None and dims in (-1, rank)


def call_args(node: fx.Node) -> dict[str, Any]:
    """The arguments of an op call by schema name, defaults filled in."""
    bound = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            bound[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            bound[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


def is_exact_upcast(src: torch.dtype, dst: torch.dtype) -> bool:
    """Every value of ``src`` is exactly representable in ``dst`` (f16/bf16 -> f32 -> f64)."""
    return src in FLOAT_BITS and dst in FLOAT_BITS and FLOAT_BITS[dst] > FLOAT_BITS[src]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def cast_back_user(node: fx.Node, dtype: torch.dtype) -> fx.Node | None:
    """``node``'s only user when that user is a cast to ``dtype``, else None."""
    if len(node.users) != 1:
        return None
    user = next(iter(node.users))
    return user if is_cast(user) and val(user).dtype == dtype else None


class PatternPass:
    """Base of one-pattern fusion passes. Subclasses set the class attributes and
    implement ``match`` and ``rewrite``."""

    name: ClassVar[str]
    summary: ClassVar[str]
    Options: ClassVar[type] = NoOptions
    requires: ClassVar[tuple[str, ...]] = ()
    anchors: ClassVar[tuple[Any, ...]] = ()
    # False for passes whose every anchor is a candidate (canonicalize): their misses are noise.
    record_near_misses: ClassVar[bool] = True

    def match(self, anchor: fx.Node, options: Any) -> Any:
        """Return a match object, or raise NoMatch(reason, node)."""
        raise NotImplementedError

    def rewrite(self, gm: fx.GraphModule, match: Any, options: Any) -> None:
        """Insert the fused node(s) and redirect the users of the matched value(s)."""
        raise NotImplementedError

    def candidates(self, gm: fx.GraphModule) -> list[fx.Node]:
        return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in self.anchors]

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        options = ctx.options_for(self)
        near_misses: list[NearMiss] = []
        matches = 0
        fake_mode = ir.fake_mode_of(gm)
        for anchor in self.candidates(gm):
            if anchor.graph is not gm.graph or anchor._erased:
                continue  # consumed by an earlier rewrite in this pass
            try:
                found = self.match(anchor, options)
            except NoMatch as miss:
                if self.record_near_misses:
                    stop = miss.node.name if miss.node is not None else anchor.name
                    near_misses.append(NearMiss(self.name, anchor.name, stop, miss.reason))
                continue
            if not ctx.allow_rewrite(self.name, anchor):
                near_misses.append(NearMiss(self.name, anchor.name, anchor.name, "bisect limit reached"))
                continue
            existing = set(gm.graph.nodes)
            self.rewrite(gm, found, options)
            self._finish_new_nodes(gm, existing, anchor, fake_mode)
            matches += 1
        if matches:
            gm.graph.eliminate_dead_code()
            gm.recompile()
        return PassResult(gm, modified=matches > 0, stats={"matches": matches}, near_misses=near_misses)

    def _finish_new_nodes(self, gm: fx.GraphModule, existing: set, anchor: fx.Node, fake_mode) -> None:
        """Stamp new nodes with this pass, inherit the anchor's source info, infer meta['val']."""
        for node in gm.graph.nodes:
            if node in existing:
                continue
            node.meta.setdefault(ir.CREATED_BY, self.name)
            for key in _INHERITED_META:
                if key in anchor.meta:
                    node.meta.setdefault(key, anchor.meta[key])
            if "val" not in node.meta:
                ir.infer_val(node, fake_mode)


def replace_uses(old: fx.Node, new: fx.Node) -> None:
    """Point every user of ``old`` at ``new`` (``old`` dies in dead-code elimination)."""
    old.replace_all_uses_with(new)


def cast_like(gm: fx.GraphModule, node: fx.Node, like: fx.Node) -> fx.Node:
    """``node``, or a cast of it when its dtype differs from the value ``like`` it replaces.

    Call inside the rewrite's ``inserting_*`` context; fills ``node.meta["val"]``.
    """
    ir.infer_val(node)
    want = val(like).dtype
    if node.meta["val"].dtype == want:
        return node
    return gm.graph.call_function(aten._to_copy.default, (node,), {"dtype": want})


def restride_like(graph: fx.Graph, node: fx.Node, like: fx.Node) -> fx.Node:
    """``node``, or a copy of it laid out in memory as ``like`` is (same strides).

    ATen graphs from aot_autograd bake strides in: a ``view`` downstream was only legal for
    the layout the replaced value had, and some kernels (SDPA on the CPU) pick their
    output layout from their input's. So a fused op whose output is contiguous replaces
    a permuted value through ``permute -> clone -> permute back``, which a later pass that
    knows its consumer ignores strides may drop. Call inside an ``inserting_*`` context.
    """
    ir.infer_val(node)
    have, want = val(node), val(like)
    order = _dense_order(want)
    if _same_layout(have, want) or order is None:
        return node
    if order != list(range(want.dim())):
        node = graph.call_function(aten.permute.default, (node, order))
        ir.infer_val(node)
    node = graph.call_function(aten.clone.default, (node,), {"memory_format": torch.contiguous_format})
    ir.infer_val(node)
    if order != list(range(want.dim())):
        node = graph.call_function(aten.permute.default, (node, [order.index(d) for d in range(want.dim())]))
        ir.infer_val(node)
    return node


def _dense_order(t: torch.Tensor) -> list[int] | None:
    """The dims of ``t`` from outermost to innermost in memory, if it is a permuted dense tensor."""
    order = sorted(range(t.dim()), key=lambda d: (-t.stride()[d], d))
    expected = 1
    for d in reversed(order):
        if t.shape[d] != 1 and t.stride()[d] != expected:
            return None
        expected *= t.shape[d]
    return order


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and all(sa == sb for sa, sb, n in zip(a.stride(), b.stride(), a.shape) if n != 1)
