"""graphopt.quantized_embedding -> com.microsoft.GatherBlockQuantized: the rows ORT
dequantizes are the reference op's to fp32 rounding (both compute (q - zero) * scale in
fp32); a padded last group ends in a Slice; configurations the CPU kernel cannot take are
decomposed with the reason; a table tied to an int8 head is one initializer both ops read."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from graphopt.backends.onnxruntime.errors import UnsupportedOp
from graphopt.backends.onnxruntime.runtime.session import SessionRunner, create_session
from graphopt.backends.onnxruntime.target import onnxruntime
from graphopt.backends.onnxruntime.lower.translations import embedding as embedding_translation
from graphopt.backends.onnxruntime.lower.translations import translation_table
from graphopt.config import Options
from graphopt.quant.report import onnx_quantized_bytes
from graphopt.quant.groupwise import quantize_int4, quantize_int8
from tests.backends.onnxruntime._helpers import Call, export_and_run, rel_err

go = torch.ops.graphopt
ORT = Options.parse({"target": "onnxruntime", "provider": "cpu", "fallback": "error", "pipeline": []})


def quantized_table(vocab: int, hidden: int, bits: int, group: int = 32, scale_dtype: str = "float32", seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(vocab, hidden, generator=gen)
    if bits == 8:
        return table, quantize_int8(table, group, scale_dtype)
    return table, quantize_int4(table, group, True, scale_dtype, "rtn")


def embedding_module(vocab: int, hidden: int, bits: int, group: int = 32, dtype=torch.float32,
                     scale_dtype: str = "float32") -> Call:
    _, q = quantized_table(vocab, hidden, bits, group, scale_dtype)
    return Call(lambda s, ids: go.quantized_embedding(s.codes, s.scales, ids, bits, group, hidden, dtype),
                codes=q.packed, scales=q.scales)


def gbq_attributes(model) -> list[dict]:
    return [{a.name: a.value for a in node.attributes.values()}
            for node in model.model.graph if node.op_type == "GatherBlockQuantized"]


IDS = torch.tensor([[3, 0, 49, 7], [5, 5, 1, 49]])


def test_translation_is_discovered():
    assert translation_table()[go.quantized_embedding.default] is embedding_translation.quantized_embedding


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("hidden", [64, 72], ids=["whole_groups", "padded_last_group"])
def test_matches_the_reference(bits, hidden):
    module = embedding_module(50, hidden, bits)
    (out,), model = export_and_run(module, IDS)
    expected = module(IDS)
    assert out.shape == expected.shape == (2, 4, hidden) and out.dtype == torch.float32
    assert rel_err(out, expected) < 1e-7  # measured 0: the same products in fp32
    histogram = model.op_histogram()
    assert histogram.get("com.microsoft::GatherBlockQuantized") == 1 and "Gather" not in histogram
    assert ("Slice" in histogram) == (hidden == 72)  # the padded group's zero codes are cut off
    (attrs,) = gbq_attributes(model)
    assert attrs == {"gather_axis": 0, "quantize_axis": 2, "block_size": 32, "bits": bits}


def test_float16_table():
    module = embedding_module(50, 64, 4, dtype=torch.float16, scale_dtype="float16")
    (out,), _ = export_and_run(module, IDS)
    assert out.dtype == torch.float16
    # ORT rounds (q - 8) * s to fp16 once, as the reference's fp32 product cast to fp16 does.
    assert rel_err(out, module(IDS)) < 1e-3


def test_dynamic_ids_shape():
    module = embedding_module(50, 64, 4)
    dyn = torch.export.Dim.DYNAMIC
    other = torch.tensor([[9, 8, 7, 6, 5, 4, 3]])
    (out,), model = export_and_run(module, IDS, dynamic_shapes=[{0: dyn, 1: dyn}], run_inputs=[other])
    assert out.shape == (1, 7, 64) and rel_err(out, module(other)) < 1e-7
    assert model.op_histogram().get("com.microsoft::GatherBlockQuantized") == 1


@pytest.mark.parametrize("group, dtype, reason", [
    (48, torch.float32, "power-of-two block >= 16, got 48"),
    (32, torch.bfloat16, "writes float32 or float16, not BFLOAT16"),
], ids=["block_48", "bfloat16"])
def test_what_the_kernel_cannot_take_is_refused_then_decomposed(group, dtype, reason):
    module = embedding_module(50, 96, 4, group=group, dtype=dtype, scale_dtype="bfloat16" if dtype == torch.bfloat16
                              else "float32")
    with pytest.raises(UnsupportedOp, match=reason):
        export_and_run(module, IDS)
    # On the target, the op runs as its reference's standard ops instead, and the report says why.
    fn = lambda codes, scales, ids: go.quantized_embedding(codes, scales, ids, 4, group, 96, dtype)  # noqa: E731
    inputs = [module.codes, module.scales, IDS]
    compiled = onnxruntime.compile(make_fx(fn, tracing_mode="fake")(*inputs), inputs, ORT)
    (row,) = compiled.off_target_ops
    assert row["op"] == "graphopt.quantized_embedding" and row["how"] == "decomposed" and reason in row["reason"]
    torch.testing.assert_close(compiled(*inputs), fn(*inputs), rtol=0, atol=0)


def test_a_table_tied_to_an_int8_head_is_one_initializer():
    # 4160 x 64: over the exporter's 8192-element folding limit (codes and scales), as any real
    # vocabulary is, so the file keeps one copy of each behind the Reshapes ORT folds at load.
    vocab, hidden = 4160, 64
    table, q = quantized_table(vocab, hidden, 8)
    module = Call(lambda s, ids, x: (go.quantized_embedding(s.codes, s.scales, ids, 8, 32, hidden, torch.float32),
                                     go.int8_linear(x, s.codes, s.scales, 32)), codes=q.packed, scales=q.scales)
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(1))  # 3 rows: MatMulNBits
    (rows, logits), model = export_and_run(module, IDS, x)
    want_rows, want_logits = module(IDS, x)
    assert rel_err(rows, want_rows) < 1e-7 and rel_err(logits, want_logits) < 2e-2
    read = onnx_quantized_bytes(model)
    assert read["shared"] == ["gm.w_codes", "gm.w_scales"]  # each read by GatherBlockQuantized and MatMulNBits
    assert read["bytes"] == q.packed.numel() + q.scales.numel() * 4 == vocab * hidden * (1 + 4 / 32)


def test_bytes_read_count_fp16_scales_at_the_dtype_the_kernel_reads():
    # fp16 scales of an fp32 table: GatherBlockQuantized reads them as fp32 (a Cast ORT folds).
    module = embedding_module(50, 64, 4, dtype=torch.float32, scale_dtype="float16")
    (out,), model = export_and_run(module, IDS)
    assert rel_err(out, module(IDS)) < 1e-7
    read = onnx_quantized_bytes(model)
    assert read["bytes"] == 50 * 64 // 2 + 50 * 2 * 4 and read["shared"] == []


def test_bytes_read_refuse_a_weight_that_is_not_an_initializer():
    _, q = quantized_table(50, 64, 4)
    module = Call(lambda s, codes, ids: go.quantized_embedding(codes, s.scales, ids, 4, 32, 64, torch.float32),
                  scales=q.scales)
    _, model = export_and_run(module, q.packed, IDS)
    with pytest.raises(ValueError, match="GatherBlockQuantized input .* does not come from an initializer"):
        onnx_quantized_bytes(model)


@pytest.mark.parametrize("embedding_bits", [0, 4])
def test_the_option_decides_whether_onnx_gets_gather_block_quantized(embedding_bits):
    from graphopt.backends.onnxruntime.lower.export import export_graph
    from graphopt.compiler import run_pipeline
    from graphopt.frontend.trace import export_aten_graph

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Embedding(50, 64), torch.nn.Linear(64, 40, bias=False))
    program = export_aten_graph(module, (IDS,))
    config = Options.parse({"pipeline": ["canonicalize", "quantize_int4"], "pass_options": {
        "quantize_int4": {"embedding_bits": embedding_bits, "search": "rtn"}}})
    result, _ = run_pipeline(program.gm, config, None)
    model = export_graph(result.gm, [IDS], dynamic=False)
    histogram = model.op_histogram()
    assert histogram.get("com.microsoft::GatherBlockQuantized", 0) == (1 if embedding_bits else 0)
    assert histogram.get("Gather", 0) == (0 if embedding_bits else 1)  # the fp32 table's lookup
    (out,) = SessionRunner(create_session(model))(IDS)
    assert rel_err(out, result.gm(IDS)[0]) < 2e-2  # MatMulNBits' int8 activations
