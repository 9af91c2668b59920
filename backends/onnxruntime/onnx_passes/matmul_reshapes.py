"""A projection's flatten/unflatten around its MatMul, removed (``fold_flattened_matmuls``).

ATen spells ``F.linear`` on a [B, S, K] activation as ``view [B*S, K] -> mm -> view [B, S, N]``,
and the exported graph keeps all three nodes. ONNX's ``MatMul`` (and ORT's ``MatMulNBits``)
take the rank-3 activation as it is against a 2-D weight and give [B, S, N], so the two
Reshapes say nothing. They are not free where the last one is a graph output: a dynamic
session binds its outputs to torch tensors (``bound_outputs.py``), so ORT computes the
MatMul into its arena and the Reshape then copies it out. On llama-small at 4x512 that copy is
the 262 MB of logits, 0.78 s of a 4.3 s call on the AVX2 machine (page faults on a fresh
output, on top of the faults of the arena's own block). Without the Reshape the MatMul
writes the bound output directly, as eager's ``mm`` writes its own.

Shapes come from the export's metadata, so a value without one is left as it is.
"""

from __future__ import annotations

from graphopt.backends.onnxruntime.onnx_passes.attention_layout import MS_DOMAIN, fill_shape


def _rank(value) -> int | None:
    return None if value is None or value.shape is None else len(value.shape)


def _takes_any_rank(matmul) -> bool:
    """A matmul whose first input may be [..., K] against its 2-D weight, giving [..., N]."""
    if matmul.domain == MS_DOMAIN and matmul.op_type == "MatMulNBits":
        return True
    return matmul.domain == "" and matmul.op_type == "MatMul" and _rank(matmul.inputs[1]) == 2


def _unflattens(flat, x, out) -> bool:
    """Whether ``flat`` ([M, K]) is ``x`` ([d0, .., dn, K]) flattened and ``out`` ([d0, .., dn, N])
    is the matmul's [M, N] unflattened the same way: every leading dim provably equal."""
    from graphopt.backends.onnxruntime.lower.translations._common import dims_equal

    for value in (flat, x, out):
        fill_shape(value)
    if _rank(flat) != 2 or _rank(x) is None or _rank(x) < 3 or _rank(out) != _rank(x):
        return False
    return (dims_equal(flat.shape[1], x.shape[-1])
            and all(dims_equal(a, b) for a, b in zip(x.shape[:-1], out.shape[:-1])))


def fold_flattened_matmuls(model, refusals: list | None = None) -> int:
    """Rewire each ``Reshape(x) -> MatMul -> Reshape`` whose Reshapes only flatten and unflatten
    the leading axes to ``MatMul(x)``; returns how many. The first Reshape stays while
    anything else reads it (removed as unused otherwise). ``refusals`` (a list) gets a
    ``runner.Refusal`` for each such sandwich whose Reshapes do more."""
    from graphopt.backends.onnxruntime.onnx_passes.runner import Refusal

    from onnx_ir.passes.common import RemoveUnusedNodesPass

    graph = model.graph
    folded = 0
    for matmul in list(graph):
        if not matmul.inputs or matmul.inputs[0] is None or not _takes_any_rank(matmul):
            continue
        flatten = matmul.inputs[0].producer()
        out = matmul.outputs[0]
        uses = out.uses()
        if (flatten is None or flatten.op_type != "Reshape" or flatten.domain != "" or len(uses) != 1
                or out.is_graph_output()):
            continue
        unflatten = uses[0].node
        if unflatten.op_type != "Reshape" or unflatten.domain != "" or uses[0].idx != 0:
            continue
        x, result = flatten.inputs[0], unflatten.outputs[0]
        if not _unflattens(matmul.inputs[0], x, result):
            if refusals is not None:
                refusals.append(Refusal(matmul.name, "the Reshapes around it do more than flatten and unflatten "
                                        "the leading axes (or a shape is unknown)"))
            continue
        matmul.replace_input_with(0, x)
        out.shape = result.shape
        name = result.name
        result.replace_all_uses_with(out, replace_graph_outputs=True)
        if out.is_graph_output():  # the graph's output keeps the name callers bind it by
            result.name, out.name = f"{name}_unflattened", name
        folded += 1
    if folded:
        RemoveUnusedNodesPass()(model)
    return folded


class FoldFlattenedMatmuls:
    """``fold_flattened_matmuls`` as an ONNX pass (runner.py)."""

    name = "fold_flattened_matmuls"
    summary = "a projection's flatten/unflatten Reshapes around its MatMul removed"

    def run(self, model):
        from graphopt.backends.onnxruntime.onnx_passes.runner import OnnxPassResult

        refusals: list = []
        return OnnxPassResult(fold_flattened_matmuls(model, refusals), {}, refusals)


fold_flattened_matmuls_pass = FoldFlattenedMatmuls()
