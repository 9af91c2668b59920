"""attention_layout.tidy_attention_layout: attention's layout round trips leave the exported decoder,
its outputs unchanged."""

from collections import Counter

import numpy as np
import pytest
import torch

from tests.backends.onnxruntime import _helpers  # noqa: F401  (skips without onnxruntime)

import onnx_ir as ir  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

from graphopt import models  # noqa: E402
from graphopt.backends.onnxruntime.decoder import inplace_cache  # noqa: E402
from graphopt.backends.onnxruntime.onnx_passes import attention_layout, rotary_fold  # noqa: E402
from graphopt.backends.onnxruntime.decoder.generate import decode_path, export_kv_cache  # noqa: E402
from graphopt.backends.onnxruntime.onnx_passes.attention_layout import tidy_attention_layout  # noqa: E402
from graphopt.backends.onnxruntime.runtime.session import create_session  # noqa: E402
from graphopt.config import Options  # noqa: E402


def _run(model_bytes: bytes, feeds: dict) -> list[np.ndarray]:
    return create_session(model_bytes, "cpu").run(None, feeds)


def _random_feeds(session_bytes: bytes, batch: int = 3, length: int = 6) -> dict:
    rng = np.random.default_rng(0)
    feeds = {}
    for value in create_session(session_bytes, "cpu").get_inputs():
        shape = [d if isinstance(d, int) else (batch if d == "batch" else length) for d in value.shape]
        feeds[value.name] = (rng.integers(0, 200, shape) if "int64" in value.type
                             else rng.standard_normal(shape).astype(np.float32))
    return feeds


@pytest.fixture(scope="module")
def tidied_pair(tmp_path_factory):
    """llama-tiny's prefill/decode pair, and the bytes of the same two models exported with
    the tidy-up turned off (as they were before it)."""
    model = models.build("llama-tiny", seed=0).eval()
    prompt = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(0))
    untidy = tmp_path_factory.mktemp("untidy") / "model.onnx"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention_layout, "tidy_attention_layout", lambda model, refusals=None: {})
        export_kv_cache(model, prompt, untidy, config=Options(), validate_model=False)
    before = [untidy.read_bytes(), decode_path(untidy).read_bytes()]
    path = tmp_path_factory.mktemp("pair") / "model.onnx"
    result = export_kv_cache(model, prompt, path, config=Options())
    return before, path, result


def test_decode_step_reads_attention_inputs_without_layout_round_trips(tidied_pair):
    before, path, result = tidied_pair
    old = ir.from_proto(__import__("onnx").load_from_string(before[1]))
    new = ir.load(str(decode_path(path)))
    old_ops, new_ops = Counter(n.op_type for n in old.graph), Counter(n.op_type for n in new.graph)
    assert old_ops["Transpose"] > 0 and new_ops["Transpose"] == 0
    assert new_ops["Reshape"] < old_ops["Reshape"]
    assert new_ops["RotaryEmbedding"] == old_ops["RotaryEmbedding"] == 4  # q and k of 2 layers, moved not added
    assert new_ops["Shape"] < old_ops["Shape"]  # one past length for every layer
    for node in new.graph:
        if node.op_type == "GroupQueryAttention":
            q, k, v = node.inputs[:3]
            assert q.producer().op_type == k.producer().op_type == "RotaryEmbedding"
            assert v.producer().op_type in ("Split", "Slice")  # the projection's slice itself
            assert len(q.producer().inputs[0].shape) == 3
    # the same numbers, and the same greedy tokens as eager
    decode_bytes = ir.to_proto(new).SerializeToString()
    feeds = _random_feeds(decode_bytes)
    for a, b in zip(_run(before[1], feeds), _run(decode_bytes, feeds)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert result.extra["generation"]["tokens_equal"]


def test_prefill_keeps_the_rotated_key_it_returns(tidied_pair):
    before, path, _ = tidied_pair
    new = ir.load(str(path))
    old = ir.from_proto(__import__("onnx").load_from_string(before[0]))
    # the returned key needs the BNSH rotation: its rope stays, so no layer rotates twice
    assert Counter(n.op_type for n in new.graph)["RotaryEmbedding"] <= \
        Counter(n.op_type for n in old.graph)["RotaryEmbedding"]
    feeds = _random_feeds(before[0])
    for a, b in zip(_run(before[0], feeds), _run(ir.to_proto(new).SerializeToString(), feeds)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def _layout_graph(reshape_to: list[int], perm: list[int]):
    """x [b, 4, 64] -> Reshape(reshape_to) -> Transpose(perm) -> Transpose(perm) -> Reshape [b, 4, 64] -> Relu."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4, 64])
    split = [*reshape_to]
    mid_shape = split if split[0] != 0 else ["b", *split[1:]]
    transposed = [mid_shape[i] for i in perm]
    nodes = [helper.make_node("Reshape", ["x", "to4"], ["r"]), helper.make_node("Transpose", ["r"], ["t1"], perm=perm),
             helper.make_node("Transpose", ["t1"], ["t2"], perm=perm), helper.make_node("Reshape", ["t2", "to3"], ["r2"]),
             helper.make_node("Relu", ["r2"], ["y"])]
    info = [helper.make_tensor_value_info("r", TensorProto.FLOAT, mid_shape),
            helper.make_tensor_value_info("t1", TensorProto.FLOAT, transposed),
            helper.make_tensor_value_info("t2", TensorProto.FLOAT, [transposed[i] for i in perm]),
            helper.make_tensor_value_info("r2", TensorProto.FLOAT, ["b", 4, 64])]
    inits = [helper.make_tensor("to4", TensorProto.INT64, [4], reshape_to),
             helper.make_tensor("to3", TensorProto.INT64, [3], [0, 4, 64])]
    graph = helper.make_graph(nodes, "g", [x], [y], initializer=inits, value_info=info)
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


def test_a_head_split_round_trip_is_removed():
    model = _layout_graph([0, 4, 4, 16], [0, 2, 1, 3])
    stats = tidy_attention_layout(model)
    assert stats["round_trips"] == 1
    assert [n.op_type for n in model.graph] == ["Relu"]


@pytest.mark.parametrize("reshape_to, perm, why", [
    ([0, 2, 8, 16], [0, 2, 1, 3], "the Reshape moves elements between axes 1 and 2"),
    ([0, 4, 4, 16], [0, 1, 3, 2], "the Transposes are not the BNSH pair"),
])
def test_a_chain_that_moves_data_stays(reshape_to, perm, why):
    model = _layout_graph(reshape_to, perm)
    ops = [n.op_type for n in model.graph]
    stats = tidy_attention_layout(model)
    assert stats["round_trips"] == 0, why
    assert [n.op_type for n in model.graph] == ops


def test_a_shape_of_a_size_no_input_names_stays():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])
    y = helper.make_tensor_value_info("y", TensorProto.INT64, [1])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", 4])
    nodes = [helper.make_node("NonZero", ["x"], ["nz"]), helper.make_node("Cast", ["nz"], ["f"], to=TensorProto.FLOAT),
             helper.make_node("Transpose", ["f"], ["z"]), helper.make_node("Shape", ["z"], ["y"], start=0, end=1)]
    graph = helper.make_graph(nodes, "g", [x], [y], value_info=[z])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    assert tidy_attention_layout(model)["shapes"] == 0
    shape = [n for n in model.graph if n.op_type == "Shape"][0]
    assert shape.inputs[0].name == "z"


def test_the_in_place_decoder_reads_attention_inputs_without_layout_round_trips(monkeypatch):
    """export_decoder skips onnxscript's rewrites, so its layout nodes carry no shapes and its
    Transposes come in pairs; the tidy-up fills the shapes and removes them all the same.
    (test_inplace_cache.py checks this decoder's tokens against eager; the rotary fold that
    follows the tidy-up is test_rotary_fold.py's.)"""
    model = models.build("llama-tiny", seed=0).eval()
    prompt = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(rotary_fold, "fold_rotary_into_attention", lambda model, positions: {"rotary": 0})
    decoder, _ = inplace_cache.export_decoder(model, prompt, Options())
    ops = Counter(n.op_type for n in decoder.model.graph)
    assert ops["Transpose"] == 0 and ops["GroupQueryAttention"] == 2
    for node in decoder.model.graph:
        if node.op_type == "GroupQueryAttention":
            assert [v.producer().op_type for v in node.inputs[:2]] == ["RotaryEmbedding", "RotaryEmbedding"]
