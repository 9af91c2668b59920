"""The numbers an INT4 run is judged by: weight bytes, per-layer error, logits error, top-1.

- Weight bytes before / after and the per-layer relative Frobenius error of each
  dequantized weight come from the ``quantize_int4`` pass's stats (a pipeline records
  them in ``PassRecord.stats``; the report's ``passes`` list carries them):
  :func:`int4_summary` gathers them over every compiled graph. Quantized embedding tables
  (``embedding_bits``) are layers with ``kind: "embedding"``; a table tied to an LM head
  and stored once is ``shared`` and counted once.
- What ONNX Runtime reads of an exported model's quantized weights (initializers behind
  MatMulNBits / GatherBlockQuantized, in the dtype read) and the file size:
  :func:`onnx_quantized_bytes`.
- Logits error and top-1 agreement need the fp32 model's logits next to the quantized
  ones: :func:`logits_metrics`.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

PASS_NAME = "quantize_int4"


def top1_agreement(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """Fraction of positions whose argmax token equals the reference's."""
    if logits.shape != reference.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and reference {tuple(reference.shape)} differ in shape")
    return (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()


def logits_metrics(logits: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """``rel_error`` = ||logits - ref||_F / ||ref||_F, ``max_abs_error``, ``top1_agreement``."""
    a, b = logits.detach().double().cpu(), reference.detach().double().cpu()
    if a.shape != b.shape:
        raise ValueError(f"logits {tuple(a.shape)} and reference {tuple(b.shape)} differ in shape")
    ref = b.norm().item()
    err = (a - b).norm().item()
    return {
        "rel_error": err / ref if ref > 0 else (0.0 if err == 0 else float("inf")),
        "max_abs_error": (a - b).abs().max().item() if a.numel() else 0.0,
        "top1_agreement": top1_agreement(a, b),
    }


def _records(source: Any) -> Iterable[dict]:
    """PassRecord dicts from a CompileReport, its ``to_dict()``, a PipelineResult, or a list of those."""
    if isinstance(source, (list, tuple)):
        for item in source:
            yield from _records(item)
        return
    if hasattr(source, "to_dict") and hasattr(source, "passes"):  # CompileReport
        source = source.to_dict()
    passes = source.get("passes") if isinstance(source, dict) else getattr(source, "records", None)
    for record in passes or ():
        yield record if isinstance(record, dict) else record.to_dict()


def int4_summary(source: Any) -> dict[str, Any] | None:
    """Byte totals, ratios and per-layer errors of every ``quantize_int4`` run in ``source``
    (CompileReports, their dicts, or PipelineResults); None when the pass never ran."""
    stats = [r["stats"] for r in _records(source) if r.get("name") == PASS_NAME and r.get("stats")]
    if not stats:
        return None
    return summarize_layers([layer for s in stats for layer in s.get("layers", [])])


def summarize_layers(layers: list[dict[str, Any]]) -> dict[str, Any]:
    """Byte totals over distinct weights (a weight two GEMMs share counts once), errors, and
    the layer list: the pass's stats for one graph, and the report's total over graphs."""
    distinct = [layer for layer in layers if not layer.get("shared")]
    before = sum(layer["bytes_before"] for layer in distinct)
    fp32 = sum(layer["bytes_fp32"] for layer in distinct)
    after = sum(layer["bytes_after"] for layer in distinct)
    errors = [layer["rel_error"] for layer in distinct if layer["rel_error"] is not None]  # None: a lazy weight
    return {
        "quantized_weights": len(distinct),
        "weight_bytes_before": before,
        "weight_bytes_after": after,
        "weight_bytes_fp32": fp32,
        "bytes_ratio_fp32": after / fp32 if fp32 else 0.0,
        "bits": {b: sum(1 for layer in distinct if layer.get("bits", 4) == b) for b in (4, 8)},
        "max_rel_error": max(errors, default=0.0),
        "mean_rel_error": sum(errors) / len(errors) if errors else 0.0,
        "layers": layers,
    }


def layer_rows(summary: dict[str, Any]) -> list[list[Any]]:
    """Rows ``[name, shape, bits, group, symmetric, rel_error, output_error, bytes before, bytes after]``
    for a table (output_error: share of the layer's output changed on the calibration
    activations, "-" when the pass did not calibrate)."""
    return [[layer["name"], "x".join(map(str, layer["shape"])), layer.get("bits", 4), layer["group_size"],
             layer["symmetric"], "-" if layer["rel_error"] is None else round(layer["rel_error"], 5),
             "-" if layer.get("output_error") is None else round(layer["output_error"], 6),
             layer["bytes_before"], layer["bytes_after"]]
            for layer in summary["layers"]]


# ONNX ops that read quantized weights, and which of their inputs hold them (codes, scales, zero points).
# A block-quantized checkpoint weight's offsets reach the model through a FusedMatMul of the
# input's block sums (translations/quant_blocks.py); a FusedMatMul of no constant is not one.
_QUANTIZED_INPUTS = {"MatMulNBits": (1, 2, 3), "GatherBlockQuantized": (0, 2, 3), "FusedMatMul": (1,)}
_OPTIONAL_CONSTANT = {"FusedMatMul"}
_FOLDED_AT_LOAD = ("Reshape", "Transpose", "Cast", "Unsqueeze")  # ONNX Runtime folds these of a constant when it loads


def constant_behind(value: Any) -> Any:
    """The initializer ``value`` is, or is a Reshape / Transpose / Cast / Unsqueeze of (ORT folds
    those at load, so the op reads a constant); else None."""
    while value is not None:
        if value.const_value is not None:
            return value
        producer = value.producer()
        if producer is None or producer.op_type not in _FOLDED_AT_LOAD or not producer.inputs:
            return None
        value = producer.inputs[0]
    return None


def onnx_quantized_bytes(model: Any, path: str | None = None) -> dict[str, Any]:
    """What ONNX Runtime reads for the quantized weights of an exported model (an onnx_ir
    ``Model`` or graphopt's ``OnnxModel``): each initializer behind a ``MatMulNBits`` or
    ``GatherBlockQuantized`` weight input (through Reshape / Transpose / Cast, which ORT folds
    at load), counted once per dtype however many ops read it, in the dtype the op reads (a
    Cast's output dtype). ``shared``: initializers both op types read (a tied table).
    ``file_bytes``: the size of the saved model at ``path`` (with its external data file,
    if any), else None."""
    import os

    import onnx_ir as ir

    graph = getattr(model, "model", model).graph
    read: dict[str, int] = {}
    readers: dict[str, set[str]] = {}
    for node in ir.traversal.RecursiveGraphIterator(graph):
        for index in _QUANTIZED_INPUTS.get(node.op_type, ()):
            if index >= len(node.inputs) or node.inputs[index] is None:
                continue
            value = node.inputs[index]
            source = constant_behind(value)
            if source is None and node.op_type in _OPTIONAL_CONSTANT:
                continue
            if source is None:
                raise ValueError(f"{node.op_type} input {value.name} does not come from an initializer")
            dtype = value.dtype or source.dtype  # one Cast target: one folded copy, whoever reads it
            read[f"{source.name}:{dtype.name}"] = int(source.const_value.size * dtype.itemsize)
            readers.setdefault(source.name, set()).add(node.op_type)
    file_bytes = None
    if path is not None:
        data = os.path.join(os.path.dirname(os.fspath(path)), os.path.basename(os.fspath(path)) + ".data")
        file_bytes = os.path.getsize(path) + (os.path.getsize(data) if os.path.exists(data) else 0)
    return {"bytes": sum(read.values()), "initializers": read,
            "shared": sorted(name for name, ops in readers.items() if len(ops) > 1), "file_bytes": file_bytes}
