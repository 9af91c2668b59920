"""graphopt.generate on the reference Llama: eager's tokens, one compilation for every decode step."""

import pytest
import torch

import graphopt
from graphopt import models
from graphopt.generation import GenerateResult, Sampler, eager_generate, generate_with_reference
from graphopt.generation.static import StepCache

NEW = 12


@pytest.fixture(scope="module")
def model():
    return models.build("llama-tiny", seed=0)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def pair(model, prompt):
    """graphopt.generate and the eager loop, run in lockstep."""
    graphopt.reset()
    return generate_with_reference(model, prompt, NEW, options={"target": "eager", "fallback": "error"})


@pytest.fixture(scope="module")
def greedy(pair):
    return pair[0]


def test_greedy_tokens_equal_eager_with_its_growing_cache(model, prompt, pair):
    greedy, reference = pair
    assert greedy.sequences.shape == (2, 5 + NEW)
    assert torch.equal(greedy.sequences, reference.sequences)
    assert torch.equal(reference.sequences, eager_generate(model, prompt, NEW).sequences)
    assert greedy.fallback is None and reference.compiles == 0
    assert greedy.target == "eager" and reference.target == "eager" and greedy.new_lengths == [NEW, NEW]
    assert len(reference.ms_per_token) == len(greedy.ms_per_token) == NEW - 1


def test_one_compilation_serves_every_decode_step(greedy):
    assert greedy.compiles == 1 and greedy.prefill_compiles == 1
    assert len(greedy.ms_per_token) == NEW - 1 and all(ms > 0 for ms in greedy.ms_per_token)
    prefill, decode = greedy.reports
    layout = {p.name: p for p in decode.passes}["static_kv_cache"]
    assert layout.status == "changed" and layout.matches == 4  # 2 layers x (k, v)
    # Each layer's two writes and two rotations became one op (fuse_rope_kv_cache_update).
    assert decode.op_counts["graphopt.rope_kv_cache_update"] == 2 and "graphopt.kv_cache_update" not in decode.op_counts
    assert "no CUDA graph captured: the graph runs on cpu" in greedy.cuda_graphs


def test_int4_on_the_eager_target_says_it_runs_the_slow_reference(model, prompt):
    from graphopt.compiler import REFERENCE_QUANTIZED_NOTE

    graphopt.reset()
    out = graphopt.generate(model, prompt, 2, options={"target": "eager", "int4": True, "fallback": "error"})
    assert out.target == "eager" and REFERENCE_QUANTIZED_NOTE in out.notes


def test_the_step_cache_compiles_again_only_for_a_new_signature():
    made = []
    cache = StepCache(lambda ids, pos, past: made.append(ids.shape) or type("S", (), {"compile_s": 0.0})())
    ids, pos = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)
    for _ in range(5):
        cache.get(ids, pos, [])
    cache.get(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long), [])
    assert cache.compiles == 2 and made == [(1, 1), (1, 2)]


def test_seeded_sampling_matches_the_eager_loop(model, prompt):
    kwargs = dict(do_sample=True, temperature=0.7, top_k=20, seed=5)
    model.train()  # graphs are for inference: generate decodes in eval mode and gives the mode back
    try:
        out = graphopt.generate(model, prompt, 8, options={"target": "eager", "fallback": "error",
                                                           "pass_options": {"static_kv_cache": {"layout": "paged",
                                                                                                "block_size": 4}}},
                                **kwargs)
        assert model.training and all(m.training for m in model.modules())
    finally:
        model.eval()
    assert out.compiles == 1 and out.fallback is None
    assert torch.equal(out.sequences, eager_generate(model, prompt, 8, **kwargs).sequences)
    assert not torch.equal(out.sequences, eager_generate(model, prompt, 8, **{**kwargs, "seed": 6}).sequences)


def test_sampler_top_k_one_is_greedy_and_temperature_flattens():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    assert Sampler(True, 1.0, 1, 0, "cpu")(logits).item() == 1
    draws = torch.cat([Sampler(True, 100.0, None, s, "cpu")(logits) for s in range(64)])
    assert len(set(draws.flatten().tolist())) == 4  # hot enough to reach every token


def test_falls_back_to_eager_and_says_why(model, prompt):
    class Peeks(torch.nn.Module):
        """Reads the concatenated cache outside attention: no static cache is possible."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, past_key_values=None, position_ids=None):
            logits, cache = self.inner(input_ids, past_key_values, position_ids)
            return logits + cache[0][0].mean(), cache

    peeks = Peeks(model).eval()
    out = graphopt.generate(peeks, prompt[:1], 3, options={"target": "eager"})
    assert out.fallback and "only attention may read" in out.fallback
    assert torch.equal(out.sequences, eager_generate(peeks, prompt[:1], 3).sequences)
    with pytest.raises(graphopt.GraphoptError, match="step for target eager failed"):
        graphopt.generate(peeks, prompt[:1], 3, options={"target": "eager", "fallback": "error"})


@pytest.mark.parametrize("call, message", [
    (lambda m, p: graphopt.generate(m, p.float(), 2), "input_ids must be an integer tensor"),
    (lambda m, p: graphopt.generate(m, p, 4, max_length=6), "pass max_length >= 8"),
    (lambda m, p: graphopt.generate(m, p, 2, do_sample=True, temperature=0), "temperature must be > 0"),
    (lambda m, p: graphopt.generate(torch.nn.Linear(2, 2), p, 2), "cannot drive Linear"),
    (lambda m, p: graphopt.generate(m, p, 2, options={"layout": "paged"}), "unknown graphopt option 'layout'"),
])
def test_bad_input_fails_with_one_line(model, prompt, call, message):
    with pytest.raises(graphopt.GraphoptError, match=message) as info:
        call(model, prompt)
    assert "\n" not in str(info.value)


def test_zero_new_tokens_returns_the_prompt(model, prompt):
    out = graphopt.generate(model, prompt, 0)
    assert isinstance(out, GenerateResult) and torch.equal(out.sequences, prompt) and out.compiles == 0
