"""rotary_fold.fold_rotary_into_attention: the in-place decoder's RotaryEmbeddings move into
GroupQueryAttention (do_rotary with position-indexed cos/sin caches) and q/k/v reach it packed;
the tokens stay eager's, and a table that is not a function of each position alone is left."""

from collections import Counter

import numpy as np
import pytest
import torch

from tests.backends.onnxruntime import _helpers  # noqa: F401  (skips without onnxruntime)

import onnx_ir as ir  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

from graphopt import models  # noqa: E402
from graphopt.backends.onnxruntime.decoder import inplace_cache  # noqa: E402
from graphopt.backends.onnxruntime.onnx_passes import rotary_fold  # noqa: E402
from graphopt.backends.onnxruntime.decoder.decoder import OrtRunner  # noqa: E402
from graphopt.config import Options  # noqa: E402
from graphopt.errors import GraphoptError  # noqa: E402
from graphopt.generation import Sampler, drive, eager_generate  # noqa: E402

PROMPT = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def tiny():
    return models.build("llama-tiny", seed=0).eval()


@pytest.fixture(scope="module")
def folded(tiny):
    """The in-place decoder, and the same export without the fold."""
    model, _ = inplace_cache.export_decoder(tiny, PROMPT, Options())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rotary_fold, "fold_rotary_into_attention", lambda model, positions: {"rotary": 0})
        plain, _ = inplace_cache.export_decoder(tiny, PROMPT, Options())
    return model, plain


def test_attention_rotates_packed_qkv_itself(tiny, folded):
    model, plain = folded
    ops, before = Counter(n.op_type for n in model.model.graph), Counter(n.op_type for n in plain.model.graph)
    assert before["RotaryEmbedding"] == 4 and ops["RotaryEmbedding"] == 0
    assert ops["Cos"] == ops["Sin"] == 0  # the per-step table computation went with them
    assert sum(ops.values()) < sum(before.values()) - 8
    cos = model.model.graph.initializers["rotary_cos_cache"].const_value.numpy()
    head = tiny.config.hidden_size // tiny.config.num_heads
    assert cos.shape == (tiny.config.max_seq_len, head // 2)
    freqs = 1.0 / tiny.config.rope_theta ** (torch.arange(0, head, 2).double() / head)
    np.testing.assert_allclose(cos, torch.cos(torch.arange(cos.shape[0]).double()[:, None] * freqs).numpy(),
                               atol=2e-3)  # fp32 angles of positions up to max_seq_len
    for node in model.model.graph:
        if node.op_type == "GroupQueryAttention":
            assert node.attributes["do_rotary"].value == 1
            assert node.inputs[1] is None and node.inputs[2] is None  # q, k, v packed in the query
            assert [x.name for x in node.inputs[7:10]] == ["rotary_cos_cache", "rotary_sin_cache", "position_ids"]
    assert model.model.metadata_props[inplace_cache.ROTARY_POSITIONS] == str(tiny.config.max_seq_len)


def test_padded_batch_tokens_equal_eager_with_the_fold(tiny, folded):
    prompts = [[5, 9, 11, 4, 7, 20, 3], [8, 12], [6, 10, 14, 15]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    runner = OrtRunner.from_decoder(folded[0].to_bytes(), max_length=8)  # the buffer doubles on the way
    out = drive([runner], ids, mask, 10, [Sampler()])[0]
    assert [out.token_ids(i) for i in range(3)] == [eager_generate(tiny, torch.tensor([p]), 10).token_ids(0)
                                                    for p in prompts]


def test_runner_refuses_a_sequence_past_the_rotary_cache(tiny, folded):
    runner = OrtRunner.from_decoder(folded[0].to_bytes(), max_length=300)  # a buffer longer than the table
    assert runner.decoder.max_positions == tiny.config.max_seq_len
    runner.prefill(PROMPT, None)
    runner.batch.lengths = np.full(2, tiny.config.max_seq_len)  # as if 256 tokens had been decoded
    with pytest.raises(GraphoptError, match="longer than the 256 positions"):
        runner.step(torch.tensor([[1], [2]]), tiny.config.max_seq_len)


def _table_model(scaled_by_longest: bool) -> tuple[ir.Model, tuple]:
    """position_ids [B, S] -> cos/sin tables [B*S, 4] of angle pos * f (or pos * f / max(pos))."""
    freqs = helper.make_tensor("freqs", TensorProto.FLOAT, [1, 4], [1.0, 0.5, 0.25, 0.125])
    nodes = [helper.make_node("Cast", ["position_ids"], ["pos"], to=TensorProto.FLOAT),
             helper.make_node("Reshape", ["pos", "column"], ["pos_col"])]
    if scaled_by_longest:  # a table that reads every position: dynamic-NTK-like scaling
        nodes += [helper.make_node("ReduceMax", ["pos"], ["longest"], keepdims=0),
                  helper.make_node("Div", ["pos_col", "longest"], ["scaled"])]
    nodes += [helper.make_node("MatMul", ["scaled" if scaled_by_longest else "pos_col", "freqs"], ["angle"]),
              helper.make_node("Cos", ["angle"], ["cos"]), helper.make_node("Sin", ["angle"], ["sin"])]
    column = helper.make_tensor("column", TensorProto.INT64, [2], [-1, 1])
    graph = helper.make_graph(nodes, "tables",
                              [helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("cos", "sin")],
                              [freqs, column])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    values = {v.name: v for node in model.graph for v in node.outputs}
    return model, (values["cos"], values["sin"])


def test_tables_are_read_per_absolute_position():
    model, tables = _table_model(scaled_by_longest=False)
    (cos, sin), reason = rotary_fold._rotary_tables(model, tables, 16)
    assert reason is None and cos.shape == (16, 4)
    angle = np.arange(16)[:, None] * np.array([1.0, 0.5, 0.25, 0.125])
    np.testing.assert_allclose(cos, np.cos(angle), atol=1e-6)
    np.testing.assert_allclose(sin, np.sin(angle), atol=1e-6)


def test_skips_a_table_that_depends_on_more_than_the_position():
    model, tables = _table_model(scaled_by_longest=True)
    found, reason = rotary_fold._rotary_tables(model, tables, 16)
    assert found == [] and reason == "a position's rotary row depends on more than its position"


def test_skips_without_rotary_embeddings_before_attention():
    model, _ = _table_model(scaled_by_longest=False)
    stats = rotary_fold.fold_rotary_into_attention(model, 16)
    reason = ("no GroupQueryAttention reads full-width RotaryEmbeddings alone, with a head size ORT's CPU "
              "kernel rotates (a multiple of 16)")
    assert stats == {"rotary": 0, "packed": 0, "skipped": reason}


def test_heads_of_8_keep_their_rotary_embeddings_and_decode():
    """ORT's CPU GroupQueryAttention refuses do_rotary for a head size that is no multiple of
    16 ("head_size shall be a multiple of 16"): such a model keeps its RotaryEmbedding nodes,
    and its tokens stay eager's."""
    from graphopt.models import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                         intermediate_size=64, max_seq_len=64)).eval()
    exported, _ = inplace_cache.export_decoder(model, PROMPT, Options())
    ops = Counter(n.op_type for n in exported.model.graph)
    assert ops["RotaryEmbedding"] == 4 and ops["GroupQueryAttention"] == 2
    assert all("do_rotary" not in n.attributes for n in exported.model.graph if n.op_type == "GroupQueryAttention")
    assert "rotary_cos_cache" not in exported.model.graph.initializers  # no table made for nothing
    assert inplace_cache.ROTARY_POSITIONS not in exported.model.metadata_props
    runner = OrtRunner.from_decoder(exported.to_bytes(), max_length=16)
    out = drive([runner], PROMPT, None, 6, [Sampler()])[0]
    want = eager_generate(model, PROMPT, 6)
    assert [out.token_ids(i) for i in range(2)] == [want.token_ids(i) for i in range(2)]


def _packed(graph) -> list[bool]:
    """Per GroupQueryAttention: does it read q, k, v as one packed input?"""
    return [n.inputs[1] is None and n.inputs[2] is None for n in graph if n.op_type == "GroupQueryAttention"]


def test_qwen2_biased_projection_reaches_attention_packed(ort_models):
    """Qwen2's q/k/v carry biases: the merged projection exports as MatMul + Add of the merged
    bias, then three Slices. The Add's output is the packed q/k/v with their biases, so
    graphopt.generate's decoder reads it whole (per layer three Slices fewer), and its greedy
    tokens stay eager's."""
    import graphopt
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=256)).eval()
    out = graphopt.generate(model, PROMPT, 16, options={"target": "onnxruntime", "fallback": "error"})
    graph = ort_models[-1].model.graph
    assert _packed(graph) == [True, True]
    assert all(n.inputs[0].producer().op_type == "Add" for n in graph if n.op_type == "GroupQueryAttention")
    assert Counter(n.op_type for n in graph)["Slice"] == 0
    want = eager_generate(model, PROMPT, 16)
    assert [out.token_ids(i) for i in range(2)] == [want.token_ids(i) for i in range(2)]


def _biased_qkv(width=128, bias_shape=(128,), extra_reader=False) -> tuple[ir.Model, object]:
    """x [B, S, 64] @ W [64, width] + bias, sliced on the last axis into q [0:64], k [64:96],
    v [96:128] for one GroupQueryAttention (4 heads, 2 kv heads of 16): Qwen2's layout."""
    rng = np.random.default_rng(0)
    consts = [helper.make_tensor("w", TensorProto.FLOAT, [64, width], rng.standard_normal(64 * width)),
              helper.make_tensor("bias", TensorProto.FLOAT, list(bias_shape), rng.standard_normal(np.prod(bias_shape)))]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["proj"]), helper.make_node("Add", ["proj", "bias"], ["qkv"])]
    for name, start, end in (("q", 0, 64), ("k", 64, 96), ("v", 96, 128)):
        consts += [helper.make_tensor(f"{name}_{kind}", TensorProto.INT64, [1], [value])
                   for kind, value in (("start", start), ("end", end), ("axis", -1))]
        nodes.append(helper.make_node("Slice", ["qkv", f"{name}_start", f"{name}_end", f"{name}_axis"], [name]))
    nodes.append(helper.make_node("GroupQueryAttention", ["q", "k", "v"], ["out"], domain="com.microsoft",
                                  num_heads=4, kv_num_heads=2))
    outputs = ["out"]
    if extra_reader:  # the key part is also read by another node
        nodes.append(helper.make_node("Neg", ["k"], ["k_elsewhere"]))
        outputs.append("k_elsewhere")
    graph = helper.make_graph(nodes, "qkv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 64])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs], consts)
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                                  helper.make_opsetid("com.microsoft", 1)]))
    return model, next(n for n in model.graph if n.op_type == "GroupQueryAttention")


@pytest.mark.parametrize("bias_shape", [(128,), (1, 1, 128)])
def test_packs_a_projection_behind_its_bias_add(bias_shape):
    model, node = _biased_qkv(bias_shape=bias_shape)
    assert rotary_fold._pack_qkv(node) == 1
    assert node.inputs[0].name == "qkv" and _packed(model.graph) == [True]


@pytest.mark.parametrize("layout", [
    dict(extra_reader=True),  # the key slice has a second reader
    dict(width=136, bias_shape=(136,)),  # q, k, v are not the whole projection: packed would be 8 wider
    dict(bias_shape=(2, 1, 128)),  # a bias per batch row is no last-axis bias: the width is not proved
])
def test_skips_a_biased_projection_that_cannot_be_packed(layout):
    model, node = _biased_qkv(**layout)
    assert rotary_fold._pack_qkv(node) == 0
    assert [x.name for x in node.inputs[:3]] == ["q", "k", "v"]


def test_as_a_pass_a_skip_is_a_near_miss_with_its_reason():
    from graphopt.backends.onnxruntime.onnx_passes.runner import run_onnx_passes

    model, _ = _table_model(scaled_by_longest=False)
    done = run_onnx_passes(model, [rotary_fold.FoldRotaryIntoAttention(16)])
    (record,) = done.records
    assert (record.name, record.status, record.matches, record.near_misses) == (
        "onnx:fold_rotary_into_attention", "unchanged", 0, 1)
    assert record.stats == {"matches": 0, "rotary": 0, "packed": 0}
    (miss,) = done.near_misses
    assert miss.anchor == "graph" and miss.reason.startswith("no GroupQueryAttention reads full-width")
