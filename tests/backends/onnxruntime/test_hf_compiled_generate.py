"""transformers' own ``model.generate`` with its forward compiled by graphopt: the path most
users of a Hugging Face model try first. Greedy tokens equal eager's, and the decode graphs
are served from dynamic sessions, not exported once per cache length."""

from __future__ import annotations

import gc

import pytest
import torch

import graphopt

transformers = pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")

NEW = 6
PROMPTS = (5, 9)  # two lengths: the second generate() must not export again per length
PER_SHAPE = "one static export per input shape"
LAZY = "onnxruntime: dynamo recompiled this graph static"


@pytest.fixture(scope="module")
def hf_llama():
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def generate_all(model) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for length in PROMPTS:
            ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(length))
            out.append(model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False))
    return out


def assert_compiled_generate_matches_eager(model, dynamic) -> None:
    """model.generate with ``model.forward`` compiled by graphopt: the same tokens as eager."""
    expected = generate_all(model)
    torch._dynamo.reset()
    graphopt.reset()
    # An earlier test's compiled graphs linger in reference cycles until collected, and while
    # they live their dynamic sessions serve this test's instances (reuse.py): its builds
    # would then depend on when the collector last ran.
    gc.collect()
    eager_forward = model.forward
    model.forward = torch.compile(eager_forward, backend="graphopt", dynamic=dynamic,
                                  options={"target": "onnxruntime", "fallback": "error"})
    try:
        got = generate_all(model)
    finally:
        model.forward = eager_forward
    for want, have in zip(expected, got):
        assert torch.equal(want, have)


@pytest.mark.parametrize("dynamic", [None, True], ids=["default", "dynamic"])
def test_model_generate_through_torch_compile_matches_eager(hf_llama, dynamic):
    assert_compiled_generate_matches_eager(hf_llama, dynamic)
    reports = graphopt.reports()
    assert all(r.target == "onnxruntime" for r in reports), [r.target for r in reports]
    # HF passes logits_to_keep=1, an int dynamo makes a symbol and then pins to 1: that is
    # a constant, not a reason to export the decode graph once per cache length.
    assert not [n for r in reports for n in r.notes if PER_SHAPE in n]
    # The decode step's keys and values are two cache tensors with a symbol each: attention
    # fuses, relating their lengths without a guard (passes/_attention_operands.py).
    assert all(r.fused_op_counts().get("graphopt.attention", 0) == 2 for r in reports if r.builds)
    assert not [n for r in reports for n in r.notes if "specialised" in n], [r.notes for r in reports]
    builds = [b for r in reports for b in r.builds]
    if dynamic:  # the prefill and the decode step, each dynamic from the start
        assert len(builds) == 2 and all(b["dynamic_dims"] for b in builds), builds
    else:  # dynamo's default adds a static first prefill; the static first decode step never builds
        assert len(builds) == 3, builds
        first_step = [r for r in reports if any(n.startswith(LAZY) for n in r.notes)]
        assert len(first_step) == 1 and first_step[0].builds == [], [r.notes for r in reports]


def test_the_compiled_decode_step_reads_attention_inputs_without_layout_round_trips(hf_llama, monkeypatch):
    """transformers builds each head split's Reshape target from Shape/Concat nodes: the
    layout tidy-up runs again once those are folded, so the decode step keeps no Transpose
    (it kept 4 per layer) and the prefill rotates its query on [B, S, H*D]."""
    from graphopt.backends.onnxruntime.runtime import session

    models = []
    create = session.create_session
    monkeypatch.setattr(session, "create_session", lambda model, *a, **k: models.append(model) or create(model, *a, **k))
    assert_compiled_generate_matches_eager(hf_llama, dynamic=True)
    histograms = [model.op_histogram() for model in models]
    prefill, decode = sorted(histograms, key=lambda h: h.get("Transpose", 0), reverse=True)
    assert decode.get("Transpose", 0) == 0, decode
    # The prefill returns each layer's rotated key as its cache: that Transpose stays.
    assert prefill.get("Transpose", 0) <= 5 * hf_llama.config.num_hidden_layers, prefill


@pytest.mark.parametrize("dynamic", [None, True], ids=["default", "dynamic"])
def test_a_sliding_window_cache_does_not_export_per_length(dynamic):
    """transformers' sliding-window cache keeps int counters (``cumulative_length``) that dynamo
    makes SymInt inputs no tensor's size gives: each becomes an input of the model, not a
    reason to export the graph once per cache length. The window (4) is shorter than the
    prompts, so it changes which keys each query sees."""
    config = transformers.MistralConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                                        sliding_window=4)
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).eval()
    assert_compiled_generate_matches_eager(model, dynamic)
    reports = graphopt.reports()
    assert not [n for r in reports for n in r.notes if PER_SHAPE in n], [r.notes for r in reports]
    assert len([b for r in reports for b in r.builds]) == (2 if dynamic else 3)
