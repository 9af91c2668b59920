"""Left-padded batches: prompts of different lengths in one call, each row's greedy tokens equal
to that prompt decoded alone, on the eager runner (a real attention mask), the compiled eager
target (groups of one prompt length: its step takes no mask) and onnxruntime (one batch: the
rows re-laid right-padded, GroupQueryAttention bounded by each row's length)."""

import importlib.util

import pytest
import torch

import graphopt
from graphopt import models
from graphopt.generation import StopConditions, eager_generate

from tests.generate import text_model

pytest.importorskip("transformers")
NEW = 6
PROMPTS = [[5, 9, 11, 4, 7, 20, 3], [8, 12], [6, 10, 14, 15]]  # three lengths
STOP = StopConditions(eos_token_ids=(2,), pad_token_id=1)  # text_model's </s> and <pad>


def left_padded(prompts: list[list[int]], pad: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@pytest.fixture(scope="module")
def hf_model():
    return text_model.model(len(text_model.WORDS) + 3)


@pytest.fixture(scope="module")
def alone(hf_model):
    """Each prompt decoded by itself, unpadded."""
    return [eager_generate(hf_model, torch.tensor([p]), NEW, stop=STOP).token_ids(0) for p in PROMPTS]


def test_the_eager_runner_decodes_a_padded_batch_in_one_batch(hf_model, alone):
    ids, mask = left_padded(PROMPTS)
    out = eager_generate(hf_model, ids, NEW, attention_mask=mask, stop=STOP)
    assert [out.token_ids(i) for i in range(3)] == alone
    assert any(2 in row for row in alone)  # a row stopped early (EOS): padded after it, the others went on
    assert out.notes == []  # one batch, not groups
    # the mask matters: the same ids without it attend to the padding and decode otherwise
    unmasked = eager_generate(hf_model, ids, NEW, stop=STOP)
    assert [unmasked.token_ids(i) for i in range(3)] != alone


def test_model_generate_agrees_on_the_padded_batch(hf_model):
    ids, mask = left_padded(PROMPTS)
    with torch.no_grad():
        expected = hf_model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=1)
    out = eager_generate(hf_model, ids, NEW, attention_mask=mask, stop=STOP)
    assert torch.equal(out.sequences, expected)  # EOS rows padded with pad_token_id, as model.generate does


needs_ort = pytest.mark.skipif(not importlib.util.find_spec("onnxruntime"), reason="onnxruntime is not installed")
# Where each target decodes a padded batch: in groups of one prompt length, or in one batch.
GROUPED = {"eager": ["the padded batch of 3 decoded as 3 groups of one prompt length: the eager step takes no "
                     "attention mask"], "onnxruntime": []}


@pytest.mark.parametrize("target", ["eager", pytest.param("onnxruntime", marks=needs_ort)])
def test_every_row_equals_its_prompt_alone(hf_model, alone, target):
    ids, mask = left_padded(PROMPTS)
    out = graphopt.generate(hf_model, ids, NEW, attention_mask=mask, stop=STOP,
                            options={"target": target, "fallback": "error"})
    assert out.target == target and out.fallback is None
    assert [out.token_ids(i) for i in range(3)] == alone
    assert torch.equal(out.sequences[:, :ids.shape[1]], ids)
    assert out.notes == GROUPED[target]
    assert 0 < len(out.ms_per_token) <= NEW - 1


@needs_ort
def test_onnxruntime_decodes_the_built_in_llama_padded_in_one_batch():
    """graphopt's own Llama takes no mask eagerly, yet ORT's per-row lengths decode it padded."""
    model = models.build("llama-tiny", seed=0)
    prompts = [[5, 9, 11, 4, 7, 20, 3], [8, 12], [6, 10, 14, 15]]
    ids, mask = left_padded(prompts, pad=0)
    out = graphopt.generate(model, ids, NEW, attention_mask=mask, options={"target": "onnxruntime",
                                                                           "fallback": "error"})
    assert out.target == "onnxruntime" and out.notes == []
    assert [out.token_ids(i) for i in range(3)] == [eager_generate(model, torch.tensor([p]), NEW).token_ids(0)
                                                    for p in prompts]
    # the padding matters: a short row read with its padding as tokens decodes otherwise
    assert eager_generate(model, ids[1:2], NEW).token_ids(0) != out.token_ids(1)


def test_a_model_without_a_mask_decodes_padded_rows_in_groups():
    model = models.build("llama-tiny", seed=0)
    ids, mask = left_padded([[5, 6, 7, 8], [9, 10]], pad=0)
    out = eager_generate(model, ids, 4, attention_mask=mask)
    assert out.token_ids(1) == eager_generate(model, torch.tensor([[9, 10]]), 4).token_ids(0)
    assert "the eager step takes no attention mask" in out.notes[0]


@pytest.mark.parametrize("mask, message", [
    (torch.tensor([[1, 0, 1]]), "attention_mask must pad on the left only"),
    (torch.tensor([[1, 1, 0]]), "attention_mask must pad on the left only"),
    (torch.tensor([[1, 1]]), r"attention_mask must have input_ids' shape \(1, 3\)"),
])
def test_a_mask_that_is_not_left_padding_is_refused(hf_model, mask, message):
    with pytest.raises(graphopt.GraphoptError, match=message):
        graphopt.generate(hf_model, torch.tensor([[3, 4, 5]]), 2, attention_mask=mask)
