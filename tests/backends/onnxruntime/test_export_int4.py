"""``graphopt export --int4`` against ONNX Runtime's own MatMulNBitsQuantizer on the same model.

The fp32 file graphopt exports is quantized by ORT's quantizer (symmetric round-to-nearest,
the same block size); graphopt's --int4 file is the same export with quantize_int4 before
the lowering. Both run in ORT on the same inputs against the eager fp32 model.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from graphopt.export.validate import resample_like
from graphopt.cli.main import app
from graphopt.sources import load_model
from graphopt.quant.report import int4_summary, top1_agreement
from tests.backends.onnxruntime._helpers import rel_err  # noqa: F401  (skips without onnxruntime)

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
nbits = pytest.importorskip("onnxruntime.quantization.matmul_nbits_quantizer")

LINEARS = 2 * 4 + 1  # llama-tiny: per layer q/k/v (merged), o, gate/up (merged), down; and lm_head


def export(path, *extra) -> dict:
    result = CliRunner().invoke(app, ["export", "llama-tiny", "-o", str(path), "--json", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("int4")
    fp32, int4 = folder / "fp32.onnx", folder / "int4.onnx"
    return export(fp32), fp32, export(int4, "--int4"), int4  # quantize_int4 default: groups of 32


def run(model_or_path, inputs) -> torch.Tensor:
    source = model_or_path if isinstance(model_or_path, str) else model_or_path.SerializeToString()
    session = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(None, {session.get_inputs()[0].name: inputs.numpy()})[0])


def test_every_linear_becomes_matmulnbits_at_under_02x_the_fp32_bytes(exported):
    _, _, data, _ = exported
    (model,) = data["files"]
    q = model["int4"]
    assert q["matmulnbits"] == LINEARS and q["float_matmuls"] == 0
    assert model["op_histogram"].get("MatMul", 0) == 0
    # 4 bits + an fp32 scale per 32 (5 bits), the LM head at 8 (9 bits): between the two.
    assert 5 / 32 < q["ratio"] < 9 / 32 and q["ratio"] <= 0.2
    assert all(0 < row["top1_agreement"] <= 1 for row in model["validation"])


def bytes_behind(model, value: str, initializers: dict, producers: dict) -> int:
    """Bytes ONNX Runtime reads for a MatMulNBits input: follow it back through Cast /
    Reshape to its initializer, and count that many elements in the dtype the node gets
    (ORT folds a Cast of a constant at load, so the node reads the cast type)."""
    dtype = None
    while value not in initializers:
        node = producers[value]
        assert node.op_type in ("Cast", "Reshape"), f"{value} comes from {node.op_type}, not a constant"
        if node.op_type == "Cast" and dtype is None:
            dtype = next(a.i for a in node.attribute if a.name == "to")
        value = node.input[0]
    init = initializers[value]
    numel = int(np.prod(init.dims)) if init.dims else 1
    return numel * onnx.helper.tensor_dtype_to_np_dtype(dtype or init.data_type).itemsize


def all_nodes(graph):
    """The graph's nodes and those of its subgraphs (the If around the 8-bit head's MatMulNBits)."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from all_nodes(sub)


def test_reported_int4_bytes_are_the_bytes_matmulnbits_reads(exported):
    _, _, data, path = exported
    model = onnx.load(str(path))
    initializers = {t.name: t for t in model.graph.initializer}
    producers = {out: node for node in all_nodes(model.graph) for out in node.output}
    read = {}
    quantized = [n for n in all_nodes(model.graph) if n.op_type == "MatMulNBits"]
    assert len(quantized) == LINEARS
    for node in quantized:
        for name in node.input[1:4]:
            if name:
                read[name] = bytes_behind(model, name, initializers, producers)
    reported = data["files"][0]["int4"]["bytes"]
    assert reported == sum(read.values())
    # The pass's own figure (scales in the activations' dtype) is the same number.
    assert int4_summary({"passes": data["passes"]})["weight_bytes_after"] == reported


def test_graphopt_int4_logits_are_closer_to_fp32_than_ort_quantizer_on_the_same_export(exported):
    fp32_data, fp32_path, _, int4_path = exported
    assert fp32_data["files"][0]["int4"] is None
    ort_model = onnx.load(str(fp32_path))
    quantizer = nbits.MatMulNBitsQuantizer(ort_model, block_size=32, is_symmetric=True)
    quantizer.process()
    theirs_model = quantizer.model.model
    assert sum(n.op_type == "MatMulNBits" for n in theirs_model.graph.node) == LINEARS

    loaded = load_model("llama-tiny", seed=0, batch=4, seq_len=32, single_output=True)
    ours_err, theirs_err = [], []
    for inputs in (loaded.example_inputs[0], resample_like(loaded.example_inputs, seed=5)[0]):
        with torch.no_grad():
            reference = loaded.module(inputs)
        ours, theirs = run(str(int4_path), inputs), run(theirs_model, inputs)
        ours_err.append(rel_err(ours, reference))
        theirs_err.append(rel_err(theirs, reference))
        print(f"\nlogits rel error graphopt {ours_err[-1]:.4f} vs ORT quantizer {theirs_err[-1]:.4f}; top-1 "
              f"{top1_agreement(ours, reference):.3f} vs {top1_agreement(theirs, reference):.3f}")
    assert sum(ours_err) < sum(theirs_err)
