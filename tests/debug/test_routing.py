"""Routing observability: ``options={"record_routing": True}`` puts tokens per expert and top-k
jitter of every graphopt.moe in the report; checked against a hand computation from the router
logits, on the eager and onnxruntime targets; off, nothing in the graph or callable changes."""

from __future__ import annotations

import pytest
import torch

import graphopt
from graphopt.report import routing_table

transformers = pytest.importorskip("transformers")

from tests.passes.test_fuse_moe import HIDDEN, PIPE, moe_block  # noqa: E402


def routed_block():
    """A Mixtral block whose router picks, for each token, the experts of its two largest
    features among 0..3 (router weight 10 * identity): the routing is known by hand."""
    block = moe_block("mixtral")
    with torch.no_grad():
        block.gate.weight.copy_(torch.eye(4, HIDDEN) * 10)
    return block


def tokens(*leads):
    """[1, len(leads), HIDDEN]: token t has features 0..3 = leads[t], the rest random but small."""
    x = torch.randn(1, len(leads), HIDDEN, generator=torch.Generator().manual_seed(3)) * 0.01
    x[0, :, :4] = torch.tensor(leads, dtype=torch.float32)
    return x


A, B, C = (3.0, 2, 0, 0), (0, 0, 3.0, 2), (0, 3.0, 2, 0)  # experts {0,1}, {2,3}, {1,2}


def run(block, inputs, rel=1e-5, **options):
    """Compile ``block`` (options over the eager target, fuse_moe's pipeline), run ``inputs`` in
    order, each checked against eager at ``rel`` (None: not checked, e.g. INT4 experts)."""
    torch._dynamo.reset()
    graphopt.reset()
    opts = {"target": "eager", "fallback": "error", "pipeline": PIPE, **options}
    if not opts["pipeline"]:
        del opts["pipeline"]  # the default pipeline
    compiled = torch.compile(block, backend="graphopt", options=opts, dynamic=False)
    with torch.no_grad():
        for x in inputs:
            got = compiled(x)
            if rel is not None:
                torch.testing.assert_close(got, block(x), rtol=rel, atol=rel)
    (report,) = graphopt.reports()
    return report


def hand_counts(block, inputs, k=2):
    """Tokens per expert straight from the router logits."""
    counts = torch.zeros(4, dtype=torch.long)
    for x in inputs:
        ids = (x.reshape(-1, HIDDEN) @ block.gate.weight.t()).topk(k, -1).indices
        counts += torch.bincount(ids.reshape(-1), minlength=4)
    return counts.tolist()


@pytest.mark.parametrize("target", ["eager", "onnxruntime"])
def test_counts_and_jitter_match_the_router_logits(target):
    if target == "onnxruntime":
        pytest.importorskip("onnxruntime")
    block = routed_block()
    inputs = [tokens(A, B), tokens(A, B), tokens(A, C)]  # step 2 repeats step 1; step 3 moves token 1 to {1,2}
    report = run(block, inputs, target=target, record_routing=True)
    assert report.target == target and not report.fallbacks
    (layer,) = report.to_dict()["routing"]
    assert layer["tokens_per_expert"] == hand_counts(block, inputs) == [3, 4, 3, 2]
    assert sum(layer["tokens_per_expert"]) == 3 * 2 * 2  # calls * tokens * top_k
    assert (layer["calls"], layer["tokens"], layer["experts"], layer["k"]) == (3, 6, 4, 2)
    assert layer["imbalance"] == pytest.approx(4 / 3)
    # steps 1->2: no row changes; 2->3: token 1 of 2 changes its set
    assert (layer["topk_changes"], layer["rows_compared"]) == (1, 4)
    assert layer["topk_change_rate"] == 0.25
    assert layer["layer"] in routing_table(report.to_dict()["routing"]) and "0.250 (1/4)" in routing_table(
        report.to_dict()["routing"])


def test_int4_experts_are_recorded_too():
    # quantize_int4 turns graphopt.moe into graphopt.int4_moe; the router stays as it was
    block = routed_block()
    inputs = [tokens(A, B), tokens(A, C)]
    report = run(block, inputs, pipeline=[], int4=True, record_routing=True, rel=None)
    assert report.fused_op_counts() == {"graphopt.int4_moe": 1}, report.op_counts
    (layer,) = report.to_dict()["routing"]
    assert layer["tokens_per_expert"] == hand_counts(block, inputs) == [2, 3, 2, 1]
    assert layer["topk_change_rate"] == 0.5


def test_jitter_is_zero_when_the_same_tokens_repeat():
    block = routed_block()
    inputs = [tokens(A, B, C)] * 3
    (layer,) = run(block, inputs, record_routing=True).to_dict()["routing"]
    assert layer["topk_change_rate"] == 0.0 and layer["rows_compared"] == 6
    assert layer["tokens_per_expert"] == hand_counts(block, inputs)


def test_a_swapped_order_inside_the_top_k_is_no_change():
    # the *set* is compared: experts (0, 1) then (1, 0) is the same pair of experts
    block = routed_block()
    inputs = [tokens((3.0, 2, 0, 0)), tokens((2.0, 3, 0, 0)), tokens((0, 0, 2.0, 3))]
    (layer,) = run(block, inputs, record_routing=True).to_dict()["routing"]
    assert (layer["topk_changes"], layer["rows_compared"]) == (1, 2)


def test_off_by_default_leaves_graph_and_callable_alone(monkeypatch):
    import graphopt.routing

    def never(*args, **kwargs):
        raise AssertionError("routing instrumentation ran with record_routing off")

    monkeypatch.setattr(graphopt.routing, "add_routing_outputs", never)
    report = run(routed_block(), [tokens(A, B)])
    assert report.to_dict()["routing"] is None and report.routing is None


def test_a_graph_without_moe_says_there_was_nothing_to_record():
    report = run(torch.nn.Linear(HIDDEN, 4), [torch.randn(2, HIDDEN)], pipeline=["canonicalize"], record_routing=True)
    assert report.to_dict()["routing"] is None
    assert any("no graphopt.moe" in n for n in report.notes), report.notes


def test_option_type_is_checked():
    with pytest.raises(graphopt.errors.OptionsError, match="record_routing"):
        graphopt.Options.parse({"record_routing": "maybe"})


@pytest.fixture(scope="module")
def mixtral_config(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("mixtral") / "config.json"
    transformers.MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                               num_local_experts=4, num_experts_per_tok=2).to_json_file(str(path))
    return str(path)


@pytest.mark.slow  # compiles and decodes a 2-layer Mixtral: a minute on the loaded CI machine
def test_debug_routing_decodes_and_prints_histogram_and_jitter(mixtral_config, capsys):
    from graphopt.cli import debug_print
    from tests.debug.conftest import debug_json

    out = debug_json(mixtral_config, "--routing", "--decode-steps", "4", "--seq-len", "6")
    assert out["target"] == "eager" and out["why_empty"] is None
    assert [layer["layer"] for layer in out["layers"]] == [f"model_model_layers_{i}_mlp_gate" for i in range(2)]
    for layer in out["layers"]:
        assert layer["calls"] == 1 + 4, "the prompt, then one call per decode step"
        assert sum(layer["tokens_per_expert"]) == (6 + 4) * 2 == layer["tokens"] * layer["k"]
        assert layer["rows_compared"] == 4 - 1 and 0 <= layer["topk_changes"] <= 3
    debug_print.print_routing(out)
    text = capsys.readouterr().out
    assert "expert   0 #" in text and "top-k jitter" in text and "model_model_layers_1_mlp_gate" in text


def test_debug_routing_refuses_a_single_step(mixtral_config):
    from tests.debug.conftest import debug

    result = debug(mixtral_config, "--routing", "--decode-steps", "1", expect_code=1)
    assert "--decode-steps must be at least 2" in result.output + str(result.exception)


@pytest.mark.slow  # tries to export a Mixtral whose experts loop cannot be captured, then decodes eagerly
def test_debug_routing_names_the_expert_loop_it_cannot_capture(mixtral_config, tmp_path):
    import json

    from tests.debug.conftest import debug_json

    config = json.loads(open(mixtral_config).read())
    (tmp_path / "config.json").write_text(json.dumps({**config, "experts_implementation": "eager"}))
    out = debug_json(str(tmp_path / "config.json"), "--routing", "--decode-steps", "2", "--seq-len", "4")
    assert out["layers"] == []
    assert "trip count depends on the routing" in out["why_empty"] and "grouped_mm" in out["why_empty"], out
