"""The ``graphopt::`` custom-op library.

Every fusion pass rewrites a subgraph into one of these ops. Each op is a real
``torch.library`` custom op with a reference implementation in plain torch (so a
graph after any pass still runs eagerly on any device) and a fake implementation
(so passes can give new nodes a correct ``meta["val"]``). Backends lower each op to
their own kernel; an op a backend cannot lower runs its reference implementation.

Importing this package registers every op; ``graphopt.ops.OPS`` lists them.
``reference_of(op)`` is an op's plain-torch reference; ``graphopt.ops.decompose`` (imported by
name) turns an op node back into the ATen ops of that reference, in place, for a target that
cannot lower the op. ``kv_cache`` also describes a static cache's buffers (``StaticCacheSpec``):
the interface passes/static_kv_cache.py gives a graph and the generate loop allocates.
"""

from graphopt.ops import (activations, attention, kv_cache, linear, moe, moe_int4, norms, quant,  # noqa: F401
                          quant_blocks, rope, rope_cache)  # (importing registers the ops)
from graphopt.ops._library import OPS, op_name, reference_of

__all__ = ["OPS", "op_name", "reference_of"]
