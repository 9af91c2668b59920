"""Tracing two layers and stamping the rest gives the graph a whole trace gives: the same ops
layer for layer, each layer on its own weights, the same outputs; a model whose layers differ
is traced whole, with the reason."""

import pytest
import torch

from graphopt import ir
from graphopt.backends.onnxruntime.decoder.inplace_cache import DecoderStep
from graphopt.export.model import dims_for
from graphopt.frontend import repeated_layers
from graphopt.frontend.trace import export_aten_graph

transformers = pytest.importorskip("transformers")
AXES = [{0: "batch", 1: "sequence"}, {0: "batch", 1: "sequence"}, {0: "batch"}]


def small_lm(family: str, layers: int = 4, **extra):
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family]
    config = config_class(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, **extra)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def decoder_inputs():
    ids = torch.tensor([[5, 9, 2, 7], [1, 1, 3, 90]])
    return ids, torch.arange(4).repeat(2, 1), torch.tensor([3, 2])


def traced(model, once: bool):
    return export_aten_graph(DecoderStep(model), decoder_inputs(), dynamic_shapes=tuple(dims_for(AXES)),
                             trace_repeated_once=once)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_stamped_graph_is_the_whole_trace(family):
    model = small_lm(family)
    whole, stamped = traced(model, False), traced(model, True)
    assert stamped.notes == [f"traced 2 of 4 layers ({type(model.model.layers[0]).__name__}) and stamped the rest"]
    assert ir.op_counts(stamped.gm) == ir.op_counts(whole.gm)
    # every layer reads its own weights (tensors the attention's code makes, equal in every
    # layer, are one constant in the stamped graph)
    names = lambda gm: sorted(n.meta[ir.PARAM_NAME] for n in gm.graph.nodes  # noqa: E731
                              if n.op == "get_attr" and "lifted_tensor" not in n.meta[ir.PARAM_NAME])
    assert names(stamped.gm) == names(whole.gm)
    with torch.no_grad():
        expected, actual = whole.gm(*decoder_inputs()), stamped.gm(*decoder_inputs())
    assert len(actual) == len(expected) == 1 + 2 * 4  # logits and each layer's key and value
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_layers_that_differ_are_traced_whole():
    model = small_lm("qwen2", layer_types=["full_attention", "sliding_attention"] * 2, use_sliding_window=True,
                     sliding_window=2)
    program = traced(model, True)
    assert program.notes == ["traced every layer: layer 0 differs from layer 1 (class, weights or attributes)"]
    # the config says so too, for models whose layers do not keep their type as an attribute
    assert repeated_layers._config_problem(model, 4) == "the config's per-layer layer_types is not the same for every layer"
    assert sum(1 for n in program.gm.graph.nodes if n.op == "get_attr"
               and ".layers.3." in n.meta.get(ir.PARAM_NAME, "")) > 0


def test_a_layer_whose_weights_differ_is_no_stack():
    model = small_lm("llama")
    model.model.layers[2].mlp.up_proj = torch.nn.Linear(64, 80, bias=False)
    stack, why = repeated_layers.find_stack(model)
    assert stack is None and why == "layer 2 differs from layer 1 (class, weights or attributes)"


def test_a_trace_where_layer_one_reads_other_values_is_refused():
    """A layer whose code depends on its index beyond what the checks see: stamp refuses."""
    model = small_lm("llama")

    class Scaled(torch.nn.Module):  # layer 1 scales its input: the two traced layers differ
        def __init__(self, inner, factor):
            super().__init__()
            self.inner, self.factor = inner, factor

        def forward(self, hidden_states, *args, **kwargs):
            return self.inner(hidden_states * self.factor if self.factor != 1 else hidden_states, *args, **kwargs)

    model.model.layers = torch.nn.ModuleList(Scaled(layer, 2.0 if i == 1 else 1) for i, layer in
                                             enumerate(model.model.layers))
    for layer in model.model.layers:
        layer.factor = 1
    program = traced(model, True)  # uniform as built: stamped
    assert program.notes[0].startswith("traced 2 of 4")
    model.model.layers[1].factor = 2.0  # now an attribute differs: whole
    program = traced(model, True)
    assert program.notes[0].startswith("traced every layer: layer 0 differs")


def test_a_model_with_too_few_layers_is_traced_whole_without_a_note():
    """Two layers leave nothing to stamp: no stack, and nothing worth telling the user."""
    assert repeated_layers.find_stack(small_lm("llama", layers=2)) == (None, "")
