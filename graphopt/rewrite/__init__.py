"""The pattern-rewrite pass base and the small matchers fusion passes are built from.

A fusion pass names its anchor ops (where a match starts, usually the last op of the
pattern), a ``match`` that walks backwards from an anchor and raises :class:`NoMatch`
with a reason at the node where the pattern stops, and a ``rewrite`` that inserts the
fused op. The base class does the rest: counting, near-miss records for
``graphopt debug --why``, the bisect limit, stamping new nodes and giving them
``meta["val"]``, dead-code elimination.

``linears`` (imported by name, not re-exported here) reads a linear layer in any of its
spellings into one ``Linear`` record, for the passes that rewrite weights.
"""

from graphopt.rewrite.aten_ops import (  # noqa: F401
    ADD_OPS, BATCHED_MATMUL_OPS, CAST_OPS, DIV_OPS, GATE_ACTIVATION_OPS, GEMM_OPS, HEAVY_COMPUTE_OPS,
    IDENTITY_OPERAND, MUL_OPS, RECIPROCAL_OPS, ROW_PICK_OPS, RUNTIME_ASSERT_OPS, SCORE_OPS, SDPA_OPS, SIZE_ASSERT_OPS, SIZE_OPS,
    SOFTMAX_OPS, SPLIT_OPS, SUB_OPS, TRANSPARENT_OPS, VIEW_OPS,
)
from graphopt.rewrite.casts import (  # noqa: F401
    FLOAT_BITS, cast_back_user, cast_like, dtype_name, is_cast, is_exact_upcast, strip_casts,
)
from graphopt.rewrite.layout import replace_uses, restride_like  # noqa: F401
from graphopt.rewrite.match import (  # noqa: F401
    NoMatch, call_args, commuted, expect, expect_op, is_last_dim, is_op, last_dim, only_user, scalar,
    single_use, val,
)
from graphopt.rewrite.pattern_pass import PatternPass  # noqa: F401
from graphopt.rewrite.residual import ResidualAdd, match_residual_add  # noqa: F401
from graphopt.rewrite.slices import Piece, last_dim_pieces, same_leading_dims  # noqa: F401
