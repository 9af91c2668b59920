"""Per-op fallback on the onnxruntime target (backends/onnxruntime/lower/partition.py, compile/placement.py).

What must hold: a graphopt op without a translation becomes its reference's ATen ops and
the graph stays whole on ORT; an op the exporter cannot take runs eagerly between ORT
parts; the report names each op that did not run on ORT, how, and why; a mixture-of-
experts model keeps only its expert dispatch off ORT.

All on the CPU. Numerics: fp32, seeded random inputs; tolerances stated per test.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import graphopt
from graphopt.backends.onnxruntime.compile import placement
from graphopt.backends.onnxruntime.lower import partition, translations
from graphopt.backends.onnxruntime.target import onnxruntime
from graphopt.backends.onnxruntime.lower.translations import translation_table
from graphopt.config import Options
from tests.backends.onnxruntime._helpers import rel_err  # noqa: F401  (skips without onnxruntime)
from tests.helpers import assert_matches_eager, eager

ORT = Options.parse({"target": "onnxruntime", "provider": "cpu", "fallback": "error"})
GEN = torch.Generator().manual_seed(0)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN)


@torch.library.custom_op("partition_test::opaque", mutates_args=())
def opaque(x: torch.Tensor) -> torch.Tensor:
    """Another library's op: torch.onnx has no function for it."""
    return x.sin() * 2


opaque.register_fake(lambda x: torch.empty_like(x))


def _halves(x, w):
    h = torch.relu(x @ w) + 1  # ORT
    h = torch.ops.partition_test.opaque(h)  # eager
    return (h @ w.t()).softmax(-1)  # ORT, reads both the opaque op and the first half


def _ort_ops(compiled) -> list[str]:
    """Every ONNX op type of every ORT part the compiled graph runs."""
    parts = [m.fn for m in compiled.fn.split_graph.children() if isinstance(m, partition._Part)]
    return [n.op_type for part in parts for n in part.onnx_model.model.graph]


def test_unexportable_op_between_two_halves_runs_eagerly_between_two_ort_parts():
    x, w = randn(3, 8), randn(8, 8)
    compiled = onnxruntime.compile(make_fx(_halves)(x, w), [x, w], ORT)
    assert [p["where"] for p in compiled.partitions] == ["onnxruntime", "eager", "onnxruntime"]
    assert compiled.off_target_ops == [{"op": "partition_test.opaque", "count": 1, "how": "eager",
                                                 "reason": "torch.onnx has no translation or decomposition for it"}]
    assert {"MatMul", "Relu", "Softmax"} <= set(_ort_ops(compiled))
    torch.testing.assert_close(compiled(x, w), _halves(x, w), rtol=1e-5, atol=1e-6)
    x2 = randn(3, 8)  # the parts are sessions, not the example's values
    torch.testing.assert_close(compiled(x2, w), _halves(x2, w), rtol=1e-5, atol=1e-6)


def test_independent_work_is_gathered_into_one_ort_part_around_the_eager_op():
    # y's branch does not depend on the opaque op: it joins the first ORT part, not a third one.
    def fn(x, y):
        a = torch.ops.partition_test.opaque(x.exp())
        b = y.cos() * 3
        return a + b

    x, y = randn(4, 5), randn(4, 5)
    compiled = onnxruntime.compile(make_fx(fn)(x, y), [x, y], ORT)
    assert [p["where"] for p in compiled.partitions] == ["onnxruntime", "eager", "onnxruntime"]
    torch.testing.assert_close(compiled(x, y), fn(x, y), rtol=1e-5, atol=1e-6)


def test_an_export_that_refuses_an_op_moves_it_off_and_plans_again(monkeypatch):
    # Without the up-front tables the opaque op reaches the exporter, which names it; the next
    # round cuts it out, so the result is the same three parts.
    monkeypatch.setattr(placement, "_exporter_tables", lambda: None)
    x, w = randn(3, 8), randn(8, 8)
    compiled = onnxruntime.compile(make_fx(_halves)(x, w), [x, w], ORT)
    assert [p["where"] for p in compiled.partitions] == ["onnxruntime", "eager", "onnxruntime"]
    (row,) = compiled.off_target_ops
    assert (row["op"], row["how"]) == ("partition_test.opaque", "eager")
    assert row["reason"].startswith("op partition_test.opaque cannot be exported to ONNX Runtime")
    torch.testing.assert_close(compiled(x, w), _halves(x, w), rtol=1e-5, atol=1e-6)


def test_graphopt_op_without_translation_is_decomposed_and_the_graph_stays_whole(monkeypatch):
    table = {op: fn for op, fn in translation_table().items() if op is not torch.ops.graphopt.rms_norm.default}
    monkeypatch.setattr(translations, "translation_table", lambda: table)

    def fn(x, w):
        return torch.ops.graphopt.rms_norm(x * 2, w, 1e-6) + 1

    x, w = randn(2, 3, 40), randn(40)
    compiled = onnxruntime.compile(make_fx(fn)(x, w), [x, w], ORT)
    assert compiled.partitions == [{"where": "onnxruntime", "nodes": compiled.partitions[0]["nodes"]}]
    assert not hasattr(compiled.fn, "split_graph")  # one export of the whole graph
    assert compiled.off_target_ops == [{"op": "graphopt.rms_norm", "count": 1, "how": "decomposed",
                                                 "reason": partition.DECOMPOSED}]
    ops = {n.op_type for n in compiled.fn.onnx_model.model.graph}
    assert "SimplifiedLayerNormalization" not in ops and {"ReduceMean", "Mul"} <= ops
    torch.testing.assert_close(compiled(x, w), fn(x, w), rtol=1e-5, atol=1e-5)


def test_skips_cutting_a_graph_ort_takes_whole():
    def fn(x, w):
        return torch.ops.graphopt.rms_norm(torch.relu(x), w, 1e-6)

    x, w = randn(2, 3, 40), randn(40)
    compiled = onnxruntime.compile(make_fx(fn)(x, w), [x, w], ORT)
    assert [p["where"] for p in compiled.partitions] == ["onnxruntime"]
    assert compiled.off_target_ops == []
    assert "SimplifiedLayerNormalization" in {n.op_type for n in compiled.fn.onnx_model.model.graph}


def test_skips_reordering_around_an_in_place_write():
    # The write must happen before the read of the tensor it writes: node order is kept.
    def fn(cache, new, pos):
        torch.ops.graphopt.kv_cache_update(cache, new, pos)
        return cache * 1

    inputs = [randn(1, 2, 9, 16), randn(1, 2, 3, 16), torch.tensor(4)]
    gm = make_fx(fn)(*[t.clone() for t in inputs])
    examples = [t.clone() for t in inputs]
    compiled = onnxruntime.compile(gm, examples, ORT)
    assert torch.equal(examples[0], inputs[0])  # compiling wrote nothing into the caller's cache
    (row_decomposed, row_eager) = compiled.off_target_ops
    assert (row_decomposed["op"], row_decomposed["how"]) == ("graphopt.kv_cache_update", "decomposed")
    assert row_eager["how"] == "eager" and "in place" in row_eager["reason"]
    cache = inputs[0].clone()
    expected = fn(inputs[0].clone(), inputs[1], inputs[2])
    torch.testing.assert_close(compiled(cache, inputs[1], inputs[2]), expected, rtol=0, atol=0)


def test_graph_with_nothing_for_ort_raises_naming_the_op():
    from graphopt.backends.onnxruntime.errors import UnsupportedOp

    x = randn(3, 4)
    with pytest.raises(UnsupportedOp, match="op partition_test.opaque cannot be exported to ONNX Runtime: torch.onnx"):
        onnxruntime.compile(make_fx(lambda x: torch.ops.partition_test.opaque(x))(x), [x], ORT)


# --- done when: a mixture-of-experts model keeps only its expert dispatch off ORT --------

def _moe_models():
    transformers = pytest.importorskip("transformers")
    small = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    return {
        "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
            num_local_experts=4, num_experts_per_tok=2, **small)),
        "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40,
            **small)),
    }


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_mixture_of_experts_runs_on_ort_with_only_the_expert_dispatch_off_it(family):
    from graphopt.sources import OutputOnly

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = OutputOnly(_moe_models()[family]().eval(), "logits", causal=True)
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    graphopt.reset()
    # fuse_moe off: this test is about a foreign custom op on the partitioner (fused, the
    # block runs wholly on ORT: tests/backends/onnxruntime/test_moe.py).
    compiled = torch.compile(model, backend="graphopt", options={"target": "onnxruntime", "fallback": "error",
                                                                 "disable_passes": ["fuse_moe"]})
    with torch.no_grad():
        out = compiled(ids)
    assert_matches_eager(out, eager(model, ids), rel=1e-4)
    reports = [r.to_dict() for r in graphopt.reports()]
    assert {r["target"] for r in reports} == {"onnxruntime"} and not any(r["fallbacks"] for r in reports)
    off = [row for r in reports for row in r["off_target_ops"]]
    assert off and {row["op"] for row in off} == {"transformers.grouped_mm_fallback"}, off
    assert all(row["how"] == "eager" and "no translation" in row["reason"] for row in off)
    assert any("graph cut into" in note for r in reports for note in r["notes"])
