"""What an exported ONNX model gets after translation, whichever route made it.

Constants folded and dead nodes dropped (onnxscript's optimizer without its pattern
rewrites), optional outputs nobody reads trimmed from ORT's fused ops, outputs cast back to
the dtypes eager returns, and dynamic axes called by their names.
"""

from __future__ import annotations

from typing import Sequence

import torch


def light_cleanup(model, infer_types: bool = True) -> None:
    """onnxscript's optimizer without its pattern rewrites: constants folded (with ONNX's
    type inference when ``infer_types``) and lifted, unused nodes and duplicate initializers
    dropped, common subexpressions merged."""
    import onnx_ir as ir
    import onnx_ir.passes.common as common
    from onnxscript.optimizer import fold_constants

    common.InlinePass()(model)
    fold_constants(model, onnx_shape_inference=infer_types)
    ir.passes.PassManager([
        common.RemoveUnusedNodesPass(), common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common.DeduplicateInitializersPass(), common.CommonSubexpressionEliminationPass(), common.OutputFixPass(),
        common.NameFixPass(),
    ])(model)


def trim_unused_outputs(model) -> int:
    """Drop trailing outputs nobody reads from ORT's fused ops.

    The exporter gives a node every output its schema lists, optional ones included; ORT
    then computes them (Skip*LayerNormalization's statistics, attention's present cache) and
    cannot even infer the type of some (MultiHeadAttention's ``qk``). Middle outputs stay,
    since ONNX outputs are positional. Returns how many nodes lost outputs.
    """
    graph_outputs = set(model.graph.outputs)
    trimmed = 0
    for node in model.graph:
        if node.domain not in ("com.microsoft",) and node.op_type not in ("SimplifiedLayerNormalization",
                                                                          "LayerNormalization"):
            continue
        keep = len(node.outputs)
        while keep > 1 and not node.outputs[keep - 1].uses() and node.outputs[keep - 1] not in graph_outputs:
            keep -= 1
        if keep < len(node.outputs):
            node.resize_outputs(keep)
            trimmed += 1
    return trimmed


def match_output_dtypes(model, dtypes: Sequence[torch.dtype]) -> int:
    """Cast each graph output whose ONNX type differs from what the FX graph returns.

    Some of the exporter's ATen translations compute in a wider type than eager returns
    (``native_layer_norm``'s mean and rstd of a float16 input come back float32; found by
    ``graphopt fuzz``). The caller was promised eager's dtypes, so the model casts back.
    Returns how many outputs got a Cast.
    """
    import onnx_ir as ir
    from onnx_ir.tensor_adapters import from_torch_dtype

    casts = 0
    for index, (value, dtype) in enumerate(zip(list(model.graph.outputs), dtypes)):
        want = from_torch_dtype(dtype)
        if value.dtype is None or value.dtype == want:
            continue
        cast = ir.node("Cast", inputs=[value], attributes={"to": want}, name=f"graphopt_output_cast_{index}")
        model.graph.append(cast)
        out = cast.outputs[0]
        out.dtype, out.shape = want, value.shape
        out.name, value.name = value.name, f"{value.name}_before_cast"
        model.graph.outputs[index] = out
        casts += 1
    return casts


def name_dynamic_axes(model, names: Sequence[dict[int, str] | None]) -> int:
    """Call each dynamic axis by its name (``batch``) instead of the tracer's ``s26``; returns
    how many symbols were renamed."""
    import onnx_ir as ir

    renames = {}
    for value, axes in zip(model.graph.inputs, names):
        for axis, name in (axes or {}).items():
            current = value.shape[axis] if value.shape is not None else None
            if isinstance(current, ir.SymbolicDim) and current.value:
                renames[current.value] = name
    values = [*model.graph.inputs, *(out for node in model.graph for out in node.outputs)]
    for value in values:
        if value.shape is not None and any(isinstance(d, ir.SymbolicDim) and d.value in renames for d in value.shape):
            value.shape = ir.Shape([renames.get(d.value, d.value) if isinstance(d, ir.SymbolicDim) else d
                                    for d in value.shape])
    return len(renames)


# --- the same rewrites as ONNX passes (runner.py) ---------------------------------------------


class LightCleanup:
    name = "light_cleanup"
    summary = "constants folded and lifted, unused nodes and duplicate initializers dropped, CSE"

    def __init__(self, infer_types: bool = True) -> None:
        self.infer_types = infer_types

    def run(self, model):
        from graphopt.backends.onnxruntime.onnx_passes.runner import OnnxPassResult, node_count

        before = node_count(model)
        light_cleanup(model, self.infer_types)
        removed = max(before - node_count(model), 0)
        return OnnxPassResult(removed, {"nodes_removed": removed})


class TrimUnusedOutputs:
    name = "trim_unused_outputs"
    summary = "trailing outputs nobody reads dropped from ORT's fused ops"

    def run(self, model):
        from graphopt.backends.onnxruntime.onnx_passes.runner import OnnxPassResult

        return OnnxPassResult(trim_unused_outputs(model))


class MatchOutputDtypes:
    name = "match_output_dtypes"
    summary = "graph outputs cast back to the dtypes eager returns"

    def __init__(self, dtypes: Sequence[torch.dtype]) -> None:
        self.dtypes = dtypes

    def run(self, model):
        from graphopt.backends.onnxruntime.onnx_passes.runner import OnnxPassResult

        return OnnxPassResult(match_output_dtypes(model, self.dtypes))


class NameDynamicAxes:
    name = "name_dynamic_axes"
    summary = "dynamic axes called by their names (batch) instead of the tracer's (s26)"

    def __init__(self, names: Sequence[dict[int, str] | None]) -> None:
        self.names = names

    def run(self, model):
        from graphopt.backends.onnxruntime.onnx_passes.runner import OnnxPassResult

        return OnnxPassResult(name_dynamic_axes(model, self.names))
