"""graphopt.quantized_linear -> MatMulNBits (+ a FusedMatMul of block sums and offsets) and
graphopt.quantized_gather -> GatherBlockQuantized: ORT multiplies by exactly the format's
values (fp32 rounding at accuracy_level 0), and a graph of lazy weights exports with each
weight read from its source when the model is written, not before."""

from __future__ import annotations

import pytest
import torch

from graphopt import lazy_weights
from graphopt.backends.onnxruntime.lower.export import export_graph
from graphopt.backends.onnxruntime.runtime.session import SessionRunner, create_session
from graphopt.backends.onnxruntime.lower.translations import int4 as int4_translation
from graphopt.ops.quant_blocks import BlockFormat
from tests.backends.onnxruntime._helpers import Call, export_and_run, rel_err
from tests.ops.test_quant_blocks import FORMATS, random_blocks, torch_parts
from tests.passes.test_keep_checkpoint_quantization import IDS, lazy_tiny_lm, optimized

go = torch.ops.graphopt
TIGHT, LOOSE = 1e-6, 3e-2  # level 0: fp32 summation order only; level 4: x quantized to int8 per block


@pytest.fixture
def accuracy_level(monkeypatch):
    return lambda level: monkeypatch.setattr(int4_translation, "ACCURACY_LEVEL", level)


def linear_module(fmt: BlockFormat, bias: bool) -> Call:
    blocks = random_blocks(40, 64, fmt, seed=7)
    names = ("codes", "scales", "zeros", "offsets")
    weights = {n: t for n, t in zip(names, torch_parts(blocks)) if t is not None}
    if bias:
        weights["bias"] = torch.randn(40)
    return Call(lambda s, x: go.quantized_linear(x, s.codes, s.scales, getattr(s, "zeros", None),
                                                 getattr(s, "offsets", None), fmt.bits, fmt.group_size,
                                                 getattr(s, "bias", None)), **weights)


@pytest.mark.parametrize("level, tol", [(0, TIGHT), (4, LOOSE)])
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_quantized_linear_matches_the_reference(accuracy_level, level, tol, fmt):
    accuracy_level(level)
    module = linear_module(fmt, bias=fmt.offsets)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(1))
    (out,), model = export_and_run(module, x)
    assert rel_err(out, module(x)) < tol
    ops = model.op_histogram()
    assert ops["com.microsoft::MatMulNBits"] == 1 and "MatMul" not in ops and "Transpose" not in ops
    assert ops.get("com.microsoft::FusedMatMul", 0) == int(fmt.offsets)
    # x's rank is known: its blocks are a Reshape to a constant shape, not one worked out
    # from Shape + Concat on every run (a decode step would pay both per quantized linear)
    assert "Shape" not in ops and "Concat" not in ops


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_quantized_gather_matches_the_reference(fmt):
    blocks = random_blocks(30, 64, fmt, seed=8)
    names = ("codes", "scales", "zeros", "offsets")
    weights = {n: t for n, t in zip(names, torch_parts(blocks)) if t is not None}
    module = Call(lambda s, ids: go.quantized_gather(s.codes, s.scales, getattr(s, "zeros", None),
                                                     getattr(s, "offsets", None), ids, fmt.bits, fmt.group_size,
                                                     torch.float32), **weights)
    ids = torch.tensor([[4, 0, 29], [29, 3, 3]])
    (out,), model = export_and_run(module, ids)
    torch.testing.assert_close(out, module(ids), rtol=0, atol=0)
    symmetric = not fmt.zeros and not fmt.offsets
    assert ("com.microsoft::GatherBlockQuantized" in model.op_histogram()) == symmetric


def test_a_lazy_model_exports_and_reads_its_codes_only_when_saved(tmp_path, accuracy_level, monkeypatch):
    """The export reads no codes (the bulk of a model): they are read one tensor at a time as
    the file is written. (A few small tensors, the scales of a tiny test table, are read while
    the exporter folds and deduplicates constants; a real model's are over its size limits.)"""
    accuracy_level(0)
    model, real = lazy_tiny_lm()
    result = optimized(model)
    reads = []
    source_of = lazy_weights.source_of

    def counting(t):
        source = source_of(t)
        if source is None:
            return None
        field = getattr(source, "name", "dense")
        return type("Counted", (), {"load": lambda self: reads.append(field) or source.load(), "shape": source.shape,
                                    "dtype": source.dtype})()

    monkeypatch.setattr(lazy_weights, "source_of", counting)
    onnx_model = export_graph(result.gm, (IDS,))
    assert "codes" not in reads
    onnx_model.save(tmp_path / "model.onnx", external_data=True)
    assert reads.count("codes") == 3  # gate_up, down, and the table its head shares
    outputs = SessionRunner(create_session(str(tmp_path / "model.onnx")))(IDS)
    with torch.no_grad():
        expected = real(IDS)
    assert rel_err(outputs[0], expected) < TIGHT * 10
