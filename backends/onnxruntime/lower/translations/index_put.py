"""``aten.index_put`` with an index tensor on every axis -> one ``ScatterND``:
``x[i0, i1, ...] = v`` -> ``ScatterND(x, Concat(Unsqueeze(i0, -1), ...), Expand(v, shape(i0)))``
(``reduction="add"`` when it accumulates). Every other form goes to torchlib's translation.

Why: torchlib's ``aten_index_put`` moves the indexed axes first and gathers the sizes of the
axes without an index through ``Constant(value_ints=<those axes>)``. When there are none
(the MoE's inverse permutation ``inv[perm] = arange(n)``), that list is empty and onnx-ir,
unable to tell an empty list's type, logs "Attribute type is ambiguous" once per node: a
warning a user cannot act on. With every axis indexed, no axis moves and nothing is
gathered, so the whole op is the scatter itself.
"""

from __future__ import annotations

import onnx_ir as ir
import torch
from onnxscript.function_libs.torch_lib.ops.core import aten_index_put

from graphopt.backends.onnxruntime.lower.translations._common import op, rank, same_shape


def index_put(self, indices, values, accumulate: bool = False):
    indices = list(indices)
    every_axis = (rank(self) is not None and len(indices) == rank(self) and all(i is not None for i in indices)
                  and all(i.dtype != ir.DataType.BOOL for i in indices))
    if not every_axis or not all(same_shape(indices[0], i) for i in indices[1:]):
        return aten_index_put(self, indices, values, accumulate)  # axes left unindexed, masks, broadcasts
    minus_one = op.Constant(value_ints=[-1])
    where = op.Concat(*[op.Unsqueeze(i, minus_one) for i in indices], axis=-1)
    updates = op.Expand(values, op.Shape(indices[0]))
    return op.ScatterND(self, where, updates, reduction="add" if accumulate else None)


TRANSLATIONS = {torch.ops.aten.index_put.default: index_put}
