"""torch.onnx's type promotion pass, reading the fake values the graph already carries.

ONNX has no implicit type promotion, so before translation torch.onnx inserts the casts ATen
implies (``add(int64, float32)`` -> ``add(cast(int64 -> float32), float32)``). Its pass
(``_fx_passes.insert_type_promotion_nodes``) runs every node of the graph again on fake
tensors to learn its operands' dtypes: 1194 fake kernels for Qwen2.5-0.5B's decoder, 2-3 s,
though a graph graphopt exports already holds each node's fake value in ``meta["val"]``.

``insert_type_promotion_nodes`` is the same pass (torch's interpreter, rules and cast
insertion) with one change: a node it does not rewrite gives its ``meta["val"]`` as its value
instead of being run again. A node it does rewrite (a cast before an operand, a new overload)
and each cast it adds run as before, so their fake values stay computed. Preconditions: every
node but the ``returns_nothing`` ones carries a true fake value (``direct_export._check``
refuses a graph that does not); those run as torch runs them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx


def insert_type_promotion_nodes(gm: fx.GraphModule) -> None:
    """The casts ONNX needs, inserted in ``gm`` in place (as torch.onnx's pass inserts them)."""
    from torch.onnx._internal.fx.passes import type_promotion

    class _FromMeta(type_promotion._TypePromotionInterpreter):
        def run_node(self, n: fx.Node) -> Any:
            if n.op in ("placeholder", "output") or "val" not in n.meta:
                return super().run_node(n)
            with self._set_current_node(n):
                if rule := type_promotion.get_type_promotion_rule(n, self.type_promotion_table):
                    # a rewritten node is run again inside, and its new value set in meta
                    self._maybe_promote_node(n, rule)
            return n.meta["val"]

    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            raise AssertionError(f"expected a GraphModule, got {type(module)}")
        transform = type_promotion.InsertTypePromotion(module)
        transform.interpreter = _FromMeta(module, transform.interpreter.type_promotion_table)
        transform.run()
