"""quantize_int4's embedding_bits: aten.embedding of a constant table -> graphopt.quantized_embedding
(round-to-nearest, symmetric, group-wise along the hidden axis), the fp32 table dropped from the
graph; a table tied to an LM head quantized at the same bits reads the head's codes (stored once),
and the bytes the report gives are what ONNX Runtime reads from the exported file."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphopt
from graphopt import ir
from graphopt.errors import OptionsError
from graphopt.pipeline import build_pass_manager
from graphopt.quant.report import int4_summary, logits_metrics, onnx_quantized_bytes
from tests.helpers import compile_with_graphopt, eager

PIPE = ["canonicalize", "quantize_int4"]
emb_op = torch.ops.graphopt.quantized_embedding.default
int8_op = torch.ops.graphopt.int8_linear.default


class EmbedThenProject(nn.Module):
    def __init__(self, vocab=96, hidden=64, out=40):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.proj = nn.Linear(hidden, out, bias=False)

    def forward(self, ids):
        return self.proj(torch.tanh(self.embed(ids)))


def stats_of(report):
    return next(p for p in report.passes if p.name == "quantize_int4").stats


def embedding_records(report):
    return [layer for layer in stats_of(report)["layers"] if layer.get("kind") == "embedding"]


def ids_for(vocab, shape=(2, 6), seed=1):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def dequantized_table(node):
    """The [vocab, hidden] table a quantized_embedding node stands for (its reference on every row)."""
    codes, scales = (ir.get_constant(a) for a in node.args[:2])
    bits, group, hidden, dtype = node.args[3:]
    return emb_op(codes, scales, torch.arange(scales.shape[0]), bits, group, hidden, dtype)


# Relative Frobenius error of a N(0, 1) table quantized by RTN at block 32: measured 0.089
# (4 bits) and 0.0052 (8 bits).
TABLE_ERROR = {4: 0.1, 8: 0.007}


@pytest.mark.parametrize("bits, hidden", [(4, 64), (8, 64), (4, 72), (8, 40)])
def test_the_reference_looks_up_rows_of_the_dequantized_table(bits, hidden):
    from graphopt.quant.groupwise import quantize_int4, quantize_int8

    table = torch.randn(30, hidden, generator=torch.Generator().manual_seed(2))
    q = quantize_int8(table, 32, "float32") if bits == 8 else quantize_int4(table, 32, True, "float32", "rtn")
    ids = torch.tensor([[0, 29, 4], [4, 4, 17]])
    rows = emb_op(q.packed, q.scales, ids, bits, 32, hidden, torch.float32)
    torch.testing.assert_close(rows, torch.nn.functional.embedding(ids, q.dequantize()), rtol=0, atol=0)
    assert ((rows - table[ids]).norm() / table[ids].norm()).item() < TABLE_ERROR[bits]


def test_a_table_in_the_wrong_format_fails_with_one_line():
    codes, scales = torch.zeros(30, 32, dtype=torch.uint8), torch.ones(30, 2)
    with pytest.raises(ValueError, match="bits must be 4 or 8, got 2"):
        emb_op(codes, scales, torch.tensor([1]), 2, 32, 64, torch.float32)
    with pytest.raises(ValueError, match=r"codes are \(30, 32\); .* need \(30, 64\)"):
        emb_op(codes, scales, torch.tensor([1]), 8, 32, 64, torch.float32)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_table_becomes_a_quantized_embedding(bits, final_graph):
    torch.manual_seed(0)
    module, ids = EmbedThenProject(), ids_for(96)
    out, report = compile_with_graphopt(module, ids, passes=PIPE,
                                        pass_options={"quantize_int4": {"embedding_bits": bits, "search": "rtn"}})
    graph = final_graph[-1]
    (node,) = [n for n in graph.graph.nodes if n.target is emb_op]
    assert not [n for n in graph.graph.nodes if n.target is torch.ops.aten.embedding.default]
    # The fp32 table is gone from the graph: nothing reads a [96, 64] float constant any more.
    assert not [n for n in graph.graph.nodes if n.op == "get_attr" and ir.get_constant(n).shape == (96, 64)
                and ir.get_constant(n).is_floating_point()]
    table = dequantized_table(node)
    weight = module.embed.weight.detach().clone()
    assert ((table - weight).norm() / weight.norm()).item() < TABLE_ERROR[bits]
    (record,) = embedding_records(report)
    assert record["bits"] == bits and record["shape"] == [96, 64] and not record["shared"]
    # Codes (4 or 8 bits a weight) + fp32 scales (what GatherBlockQuantized reads): one per
    # 32 at 4 bits; at 8 bits one per row, group_size_8bit (128) capped at the 64-wide rows.
    assert record["group_size"] == (32 if bits == 4 else 64)
    assert record["bytes_after"] == 96 * 64 * bits // 8 + 96 * (2 if bits == 4 else 1) * 4
    assert record["rel_error"] == pytest.approx(((table - weight).norm() / weight.norm()).item(), rel=1e-5)
    assert stats_of(report)["embeddings"] == 1
    # The graph computes with exactly that table: the same model holding it in fp32, its
    # projection quantized the same way (round-to-nearest is deterministic), gives the same output.
    with torch.no_grad():
        module.embed.weight.copy_(table)
    same, _ = compile_with_graphopt(module, ids, passes=PIPE, pass_options={"quantize_int4": {"search": "rtn"}})
    torch.testing.assert_close(out, same, rtol=0, atol=0)
    with torch.no_grad():
        module.embed.weight.copy_(weight)
    assert logits_metrics(out, eager(module, ids))["rel_error"] < (0.15 if bits == 4 else 0.05)


def test_off_by_default(final_graph):
    torch.manual_seed(0)
    _, report = compile_with_graphopt(EmbedThenProject(), ids_for(96), passes=PIPE)
    assert not [n for n in final_graph[-1].graph.nodes if n.target is emb_op]
    assert [n for n in final_graph[-1].graph.nodes if n.target is torch.ops.aten.embedding.default]
    assert stats_of(report)["embeddings"] == 0 and not embedding_records(report)


def test_skip_pattern_leaves_the_table_with_the_reason(final_graph):
    torch.manual_seed(0)
    _, report = compile_with_graphopt(EmbedThenProject(), ids_for(96), passes=PIPE, pass_options={
        "quantize_int4": {"embedding_bits": 4, "skip": ["*embed*"], "search": "rtn"}})
    assert not [n for n in final_graph[-1].graph.nodes if n.target is emb_op]
    reasons = [m.reason for m in report.near_misses if m.pass_name == "quantize_int4"]
    assert any("matches skip pattern '*embed*'" in r for r in reasons), reasons


@pytest.mark.parametrize("bad, message", [(3, "embedding_bits 3 is not valid"), (16, r"choose 0 \(float\), 4 or 8")])
def test_bad_embedding_bits_fail_with_one_line(bad, message):
    with pytest.raises(OptionsError, match=message) as info:
        build_pass_manager(graphopt.Options.parse({"pipeline": PIPE, "pass_options": {"quantize_int4": {
            "embedding_bits": bad}}}))
    assert "\n" not in str(info.value)


# --- a tied table (transformers Llama, tie_word_embeddings) -----------------------------------


def tied_llama(vocab=256, hidden=64):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=True, use_cache=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


class Logits(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids).logits


# Logits error against fp32 (4-bit linears, 8-bit head): measured 0.056 with the 8-bit table,
# 0.0995 with a 4-bit one (this random table has no structure for 4 bits to keep).
@pytest.mark.parametrize("embedding_bits, shared, logits_error", [(8, True, 0.08), (4, False, 0.13)],
                         ids=["same_bits_shared", "other_bits"])
def test_tied_table_is_stored_once_when_the_head_has_its_bits(embedding_bits, shared, logits_error, final_graph):
    model = tied_llama()
    ids = ids_for(256, (1, 8))
    out, report = compile_with_graphopt(Logits(model), ids, passes=PIPE, pass_options={
        "quantize_int4": {"embedding_bits": embedding_bits, "head_bits": 8, "search": "rtn"}})
    graph = final_graph[-1]
    (emb,) = [n for n in graph.graph.nodes if n.target is emb_op]
    (head,) = [n for n in graph.graph.nodes if n.target is int8_op]
    assert (emb.args[:2] == head.args[1:3]) == shared  # the very same get_attr nodes
    (record,) = embedding_records(report)
    assert record["shared"] == shared and record["tied_to"].endswith("weight")
    summary = int4_summary(report)
    vocab_hidden = 256 * 64
    # The fp32 table is one tensor in the model: counted once in the fp32 bytes either way.
    linears = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n)
    assert summary["weight_bytes_fp32"] == (linears + vocab_hidden) * 4
    head_bytes = vocab_hidden + vocab_hidden // 64 * 4  # 8 bits: one scale per 64-wide row
    extra = 0 if shared else vocab_hidden // 2 + vocab_hidden // 32 * 4  # a 4-bit copy beside the 8-bit head
    layers = [layer for layer in summary["layers"] if layer.get("kind") != "embedding" and layer["bits"] == 4]
    assert summary["weight_bytes_after"] == sum(layer["bytes_after"] for layer in layers) + head_bytes + extra
    assert logits_metrics(out, eager(Logits(model), ids))["rel_error"] < logits_error


def test_tied_llama_on_onnxruntime_reads_the_bytes_the_report_gives(tmp_path):
    """A vocabulary over the exporter's folding limit (as any real one): the file holds the
    8-bit codes and scales once, GatherBlockQuantized and MatMulNBits both read them, and the
    bytes behind their inputs equal the pass's total."""
    pytest.importorskip("onnxruntime")
    from graphopt.backends.onnxruntime.lower.export import export_graph
    from graphopt.backends.onnxruntime.runtime.session import SessionRunner, create_session
    from graphopt.compiler import run_pipeline
    from graphopt.config import Options
    from graphopt.frontend.trace import export_aten_graph

    model = Logits(tied_llama(vocab=8320))
    ids = ids_for(8320, (1, 8))
    program = export_aten_graph(model, (ids,))
    config = Options.parse({"pipeline": PIPE,
                            "pass_options": {"quantize_int4": {"embedding_bits": 8, "search": "rtn"}}})
    result, _ = run_pipeline(program.gm, config, None)
    summary = int4_summary(result)
    onnx_model = export_graph(result.gm, [ids], dynamic=False)
    histogram = onnx_model.op_histogram()
    assert histogram["com.microsoft::GatherBlockQuantized"] == 1 and histogram["com.microsoft::MatMulNBits"] == 8
    logits = SessionRunner(create_session(onnx_model))(ids)[0]
    assert logits_metrics(logits, result.gm(ids)[0])["rel_error"] < 2e-2  # MatMulNBits' int8 activations
    path = tmp_path / "tied.onnx"
    onnx_model.save(path)
    read = onnx_quantized_bytes(onnx_model, path)
    assert len(read["shared"]) == 2  # the head's codes and scales, read by both ops
    assert read["bytes"] == summary["weight_bytes_after"]
    # The export tool's figure (graphopt export's int4 line) counts the table too, and its
    # fp32 weight once: it is the head's.
    weights = onnx_model.int4_weights()
    assert weights["bytes"] == read["bytes"] and weights["embeddings"] == 1
    assert weights["fp32_bytes"] == summary["weight_bytes_before"]
    # No float copy of the table is left: the file is the quantized bytes plus small tensors.
    assert read["file_bytes"] < read["bytes"] + 8320 * 64
