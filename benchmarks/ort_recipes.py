"""ONNX Runtime's own ways to a Llama decoder, for benchmarks/ort_llama.py's peer rows: a
plain ``torch.onnx.export`` of the prefill and decode steps, ORT's transformer optimizer on
it, and ORT's INT4 recipe (MatMulNBitsQuantizer) on the optimized files. No graphopt pass runs."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from graphopt.backends.onnxruntime.decoder.generate import DecodeStep, PrefillStep


def export_plain(model, example, folder: Path) -> tuple[str, str]:
    """torch.onnx.export (dynamo) of the prefill and decode steps, no graphopt involved."""
    dyn = torch.export.Dim.DYNAMIC
    _, cache = model(example)
    flat = [t for kv in cache for t in kv]
    paths = (str(folder / "plain.onnx"), str(folder / "plain.decode.onnx"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(PrefillStep(model), (example,), dynamo=True, dynamic_shapes=({0: dyn, 1: dyn},),
                          verbose=False).save(paths[0])
        torch.onnx.export(DecodeStep(model), (example[:, -1:], *flat), dynamo=True, verbose=False,
                          dynamic_shapes=({0: dyn}, tuple({0: dyn, 2: dyn} for _ in flat))).save(paths[1])
    return paths


def optimize_with_ort(paths: tuple[str, str], config, folder: Path) -> tuple[str, str]:
    """onnxruntime.transformers.optimizer on the plain export. Every model type it offers for a
    decoder (gpt2, qwen3, gpt_neox, bert) gives the same fusions here (the norms; attention
    and rotary stay decomposed), so gpt2 it is."""
    from onnxruntime.transformers.optimizer import optimize_model

    out = []
    for path in paths:
        optimized = optimize_model(path, model_type="gpt2", num_heads=config.num_heads, hidden_size=config.hidden_size)
        target = str(folder / ("ortopt" + Path(path).name[len("plain"):]))
        optimized.save_model_to_file(target)
        out.append(target)
    return out[0], out[1]


def quantize_with_ort(paths: tuple[str, str], block_size: int, folder: Path) -> tuple[str, str]:
    """ONNX Runtime's INT4 recipe on the optimized export: MatMulNBitsQuantizer, symmetric
    round-to-nearest with ``block_size``, and the accuracy level of its fast int8-compute CPU
    kernels (graphopt's MatMulNBits use the same level, so the two race on equal kernels)."""
    import logging

    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    # The quantizer turns the root logger to INFO on import; these then print a line per node
    # (onnxscript's constant folding on every later export in this process too).
    for name in ("onnxruntime.quantization.matmul_nbits_quantizer", "onnx_ir", "onnxscript"):
        logging.getLogger(name).setLevel(logging.WARNING)
    out = []
    for path in paths:
        quantizer = MatMulNBitsQuantizer(onnx.load(path), block_size=block_size, is_symmetric=True, accuracy_level=4)
        quantizer.process()
        target = str(folder / ("ortint4" + Path(path).name[len("ortopt"):]))
        quantizer.model.save_model_to_file(target)
        out.append(target)
    return out[0], out[1]
