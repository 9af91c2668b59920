"""torch.compile(backend="graphopt") on real models: matches eager, reports what it did."""

import pytest
import torch

import graphopt
from graphopt.sources import load_model
from tests.helpers import assert_matches_eager, compile_with_graphopt, eager

REPORT_KEYS = {"backend", "target", "passes", "op_counts", "fallbacks"}
PASS_KEYS = {"name", "matches", "time_ms", "nodes_before", "nodes_after"}


def _hf_llama(layers=2):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    model = transformers.LlamaForCausalLM(config).eval()

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(ids, use_cache=False).logits

    return Logits()


def _hf_bert():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, vocab_size=128)
    bert = transformers.BertModel(config).eval()

    class Hidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, ids, mask):
            return self.bert(ids, attention_mask=mask).last_hidden_state

    return Hidden()


def test_transformers_llama_matches_eager():
    model = _hf_llama()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    out, report = compile_with_graphopt(model, ids)
    assert_matches_eager(out, eager(model, ids), rel=1e-5)
    assert report.frozen_weights > 0  # weights became constants the passes can rewrite
    assert report.op_counts.get("graphopt.rms_norm", 0) + report.op_counts.get("graphopt.add_rms_norm", 0) == 5


def test_transformers_bert_with_padding_matches_eager():
    model = _hf_bert()
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0
    out, _ = compile_with_graphopt(model, ids, mask)
    assert_matches_eager(out, eager(model, ids, mask), rel=1e-5)


@pytest.mark.parametrize("name", ["llama-tiny", "bert-tiny"])
def test_builtin_models_match_eager(name):
    loaded = load_model(name, seq_len=12)
    out, report = compile_with_graphopt(loaded.module, *loaded.example_inputs)
    assert_matches_eager(out, eager(loaded.module, *loaded.example_inputs), rel=1e-5)
    assert report.fallbacks == []


def test_report_has_the_documented_shape():
    loaded = load_model("llama-tiny", seq_len=8)
    compile_with_graphopt(loaded.module, *loaded.example_inputs)
    (report,) = graphopt.reports()
    data = report.to_dict()
    assert REPORT_KEYS <= set(data)
    assert data["backend"] == "graphopt" and data["target"] == "eager"
    assert [p["name"] for p in data["passes"]][:2] == ["canonicalize", "fuse_rms_norm"]
    for p in data["passes"]:
        assert PASS_KEYS <= set(p) and p["nodes_after"] > 0
    assert data["passes"][-1]["nodes_after"] < data["passes"][0]["nodes_before"]  # fusion shrinks the graph
    assert data["op_counts"]["graphopt.rms_norm"] >= 1
    assert all(isinstance(v, int) and v > 0 for v in data["op_counts"].values())


def test_reset_forgets_reports_and_each_graph_gets_one():
    loaded = load_model("llama-tiny", seq_len=8)
    compile_with_graphopt(loaded.module, *loaded.example_inputs)
    assert len(graphopt.reports()) == 1
    graphopt.reset()
    assert graphopt.reports() == []

    def two_graphs(x):
        y = torch.relu(x) * 2
        torch._dynamo.graph_break()
        return y + 1

    torch._dynamo.reset()
    compiled = torch.compile(two_graphs, backend="graphopt", options={"target": "eager"})
    x = torch.randn(4)
    assert torch.equal(compiled(x), two_graphs(x))
    assert len(graphopt.reports()) == 2


def test_entry_point_makes_the_backend_name_work():
    assert "graphopt" in torch._dynamo.list_backends()


def test_graphopt_compile_checks_options_up_front():
    with pytest.raises(graphopt.OptionsError, match="unknown graphopt option 'tagret'"):
        graphopt.compile(torch.nn.Linear(2, 2), options={"tagret": "eager"})


def test_export_frontend_feeds_the_same_pipeline():
    from graphopt.compiler import compile_graph
    from graphopt.frontend.trace import export_aten_graph

    loaded = load_model("llama-tiny", seq_len=8)
    program = export_aten_graph(loaded.module, loaded.example_inputs)
    assert program.frozen_weights > 0
    assert all("val" in n.meta for n in program.gm.graph.nodes if n.op != "output")
    graphopt.reset()
    run = compile_graph(program.gm, list(program.example_inputs), graphopt.Options(target="eager"), "export")
    (report,) = graphopt.reports()
    assert report.frontend == "export" and report.op_counts["graphopt.rms_norm"] >= 1
    out = run(*program.example_inputs)
    assert_matches_eager(out[0], eager(loaded.module, *loaded.example_inputs), rel=1e-5)


def test_frozen_weights_keep_their_parameter_names():
    from graphopt.frontend.trace import capture_aten_graphs
    from graphopt.ir import PARAM_NAME

    loaded = load_model("llama-tiny", seq_len=8)
    (graph,) = capture_aten_graphs(loaded.module, loaded.example_inputs)
    names = {n.meta[PARAM_NAME] for n in graph.gm.graph.nodes if n.op == "get_attr" and PARAM_NAME in n.meta}
    assert {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.lm_head.weight"} <= names
