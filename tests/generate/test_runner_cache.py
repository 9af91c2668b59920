"""graphopt.generate keeps its step runner per model: a second call compiles nothing, a weight
change or other options compile again, and copies of the model start with none."""

import copy

import pytest
import torch

import graphopt
from graphopt import models
from graphopt.generation import eager_generate
from graphopt.generation.runner_cache import ATTRIBUTE, cached_runner, forget
from graphopt.config import Options


@pytest.fixture()
def model():
    torch.manual_seed(0)
    return models.build("llama-tiny").eval()


def _ids(n=5):
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(1))


EAGER = {"target": "eager"}


def test_a_second_call_reuses_the_runner_and_its_cache_buffers(model):
    first = graphopt.generate(model, _ids(), 6, options=EAGER)
    runner = next(iter(model.__dict__[ATTRIBUTE].entries.values()))
    cache_address = runner.buffers.caches[0].data_ptr()
    second = graphopt.generate(model, _ids(), 6, options=EAGER)
    assert first.compiles >= 1 and second.compiles == 0 and second.compile_s == 0.0
    assert any("reused the step runner" in n for n in second.notes)
    assert torch.equal(first.sequences, second.sequences)
    # The same buffers, zeroed: a CUDA graph captured over their addresses replays, not recaptures.
    assert runner.buffers.caches[0].data_ptr() == cache_address


def test_another_prompt_reuses_the_decode_step_and_matches_eager(model):
    graphopt.generate(model, _ids(5), 6, options=EAGER, max_length=32)
    out = graphopt.generate(model, _ids(7), 6, options=EAGER, max_length=32)
    assert out.compiles == 0 and out.prefill_compiles == 1  # the new prompt length compiles its prefill only
    assert torch.equal(out.sequences, eager_generate(model, _ids(7), 6).sequences)


def test_changed_weights_compile_again(model):
    graphopt.generate(model, _ids(), 6, options=EAGER)
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # in place: same address, new version
    out = graphopt.generate(model, _ids(), 6, options=EAGER)
    assert out.compiles >= 1
    assert torch.equal(out.sequences, eager_generate(model, _ids(), 6).sequences)
    assert len(model.__dict__[ATTRIBUTE].entries) == 1  # the stale runner is gone


def test_other_options_and_forget_compile_again(model):
    graphopt.generate(model, _ids(), 4, options=EAGER)
    assert graphopt.generate(model, _ids(), 4, options={**EAGER, "disable_passes": ["cuda_graphs"]}).compiles >= 1
    forget(model)
    assert graphopt.generate(model, _ids(), 4, options=EAGER).compiles >= 1


def test_a_copy_of_the_model_starts_without_runners(model):
    graphopt.generate(model, _ids(), 4, options=EAGER)
    clone = copy.deepcopy(model)
    assert not clone.__dict__[ATTRIBUTE].entries
    assert graphopt.generate(clone, _ids(), 4, options=EAGER).compiles >= 1


def test_a_generate_inside_on_token_builds_its_own_runner(model):
    inner = []

    def on_token(token, live):
        if not inner:
            inner.append(graphopt.generate(model, _ids(), 3, options=EAGER))

    outer = graphopt.generate(model, _ids(), 4, options=EAGER, on_token=on_token)
    assert inner[0].compiles >= 1  # the outer call's runner was busy: not shared
    assert torch.equal(outer.sequences, eager_generate(model, _ids(), 4).sequences)
    assert torch.equal(inner[0].sequences, eager_generate(model, _ids(), 3).sequences)


class _Runner:
    compiles = prefill_compiles = 0
    compile_s = 0.0


def test_a_call_that_fails_drops_its_runner(model):
    config = Options.parse(EAGER)
    with pytest.raises(RuntimeError):
        with cached_runner(model, config, 16, _Runner) as (runner, reused):
            raise RuntimeError("the step failed")
    with cached_runner(model, config, 16, _Runner) as (again, reused):
        assert not reused and again is not runner


def test_static_runners_are_kept_per_max_length_and_bounded(model):
    config = Options.parse(EAGER)
    built = []
    for length in range(8, 16):
        with cached_runner(model, config, length, lambda: built.append(_Runner()) or built[-1]):
            pass
    with cached_runner(model, config, 15, _Runner) as (runner, reused):
        assert reused and runner is built[-1]
    assert len(model.__dict__[ATTRIBUTE].entries) == 4


def test_the_onnxruntime_runner_serves_every_prompt_length_and_max_length(model):
    pytest.importorskip("onnxruntime")
    ort = {"target": "onnxruntime"}
    first = graphopt.generate(model, _ids(5), 4, options=ort)
    assert first.target == "onnxruntime" and first.compiles == 1, (first.target, first.fallback)
    out = graphopt.generate(model, _ids(9), 6, options=ort, max_length=64)
    assert out.compiles == 0 and out.compile_s == 0.0
    assert torch.equal(out.sequences, eager_generate(model, _ids(9), 6).sequences)


def test_a_model_made_in_inference_mode_is_keyed_by_its_values():
    # Inference tensors have no version counter: the key hashes their values instead.
    from graphopt.generation.runner_cache import weights_key

    with torch.inference_mode():
        model = models.build("llama-tiny").eval()
    before = weights_key(model)
    assert weights_key(model) == before
    with torch.inference_mode():
        model.lm_head.weight.mul_(-1.0)  # in place: same address, no version to bump
    assert weights_key(model) != before
