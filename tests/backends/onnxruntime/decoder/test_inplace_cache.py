"""The in-place ORT decoder (backends/onnxruntime/decoder/inplace_cache.py, in_place.InPlaceSession): one
model whose GroupQueryAttentions read and write one KV buffer per layer, bound as past and
present; per-row lengths for padded batches. One export of llama-tiny serves every test."""

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")

from graphopt import models  # noqa: E402
from graphopt.backends.onnxruntime.decoder.decoder import OrtRunner  # noqa: E402
from graphopt.backends.onnxruntime.decoder.in_place import right_padded  # noqa: E402
from graphopt.backends.onnxruntime.decoder.inplace_cache import export_decoder  # noqa: E402
from graphopt.config import Options  # noqa: E402
from graphopt.generation import Sampler, drive, eager_generate  # noqa: E402

PROMPTS = [[5, 9, 11, 4, 7, 20, 3], [8, 12], [6, 10, 14, 15]]


@pytest.fixture(scope="module")
def tiny():
    return models.build("llama-tiny", seed=0).eval()


@pytest.fixture(scope="module")
def exported(tiny):
    model, _ = export_decoder(tiny, torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(0)),
                              Options())
    return model


@pytest.fixture(scope="module")
def decoder(exported):
    return exported.to_bytes()


def test_its_onnx_rewrites_are_reported_as_passes(exported):
    records = exported.passes.records
    names = [r.name for r in records]
    assert names[:2] == ["onnx:fold_flattened_matmuls", "onnx:light_cleanup"]
    assert names[-2:] == ["onnx:tidy_attention_layout", "onnx:fold_rotary_into_attention"]
    tidy, fold = records[-2:]
    assert tidy.status == "changed" and tidy.matches > 0
    assert fold.stats["rotary"] == 2 and fold.matches >= 2  # both layers rotate inside attention


def left_padded(prompts):
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def test_one_model_whose_attentions_share_past_and_present(decoder):
    import onnx

    graph = onnx.load_from_string(decoder).graph
    inputs, outputs = [i.name for i in graph.input], [o.name for o in graph.output]
    assert inputs == ["input_ids", "position_ids", "last", "seqlens_k", "total_sequence_length",
                      "past_key_0", "past_value_0", "past_key_1", "past_value_1"]
    assert outputs == ["logits", "present_key_0", "present_value_0", "present_key_1", "present_value_1"]
    gqa = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert [(n.input[3], n.input[5], n.input[6], n.output[1]) for n in gqa] == [
        (f"past_key_{i}", "seqlens_k", "total_sequence_length", f"present_key_{i}") for i in range(2)]
    # nothing else touches the cache: no Concat of a past, no copy between past and present
    readers = [n.op_type for n in graph.node for x in n.input if x.startswith("past_")]
    assert readers == ["GroupQueryAttention"] * 4


def test_steps_write_the_bound_buffer_in_place_at_each_rows_length(tiny, decoder):
    runner = OrtRunner.from_decoder(decoder, max_length=12)
    ids, mask = left_padded(PROMPTS)
    lengths = mask.sum(-1)
    runner.prefill(ids, mask)
    buffers = [a.ctypes.data for a in runner.decoder.cache]  # numpy buffers, bound to the session in place
    key = runner.decoder.cache[0]
    before = key.copy()
    for step in range(3):
        runner.step(torch.tensor([[3], [4], [5]]), ids.shape[1] + step)
    assert [a.ctypes.data for a in runner.decoder.cache] == buffers  # the same memory, never replaced
    for row, length in enumerate(lengths.tolist()):
        changed = np.flatnonzero((key[row] != before[row]).any(-1).any(0)).tolist()
        assert changed == [length, length + 1, length + 2]  # each step wrote its row's next slot only
    assert not key[:, :, 7 + 3:].any()  # past every row's end (prompt width 7, 3 steps) nothing was written


def test_padded_rows_equal_their_prompts_alone_through_a_growing_buffer(tiny, decoder):
    ids, mask = left_padded(PROMPTS)
    alone = [eager_generate(tiny, torch.tensor([p]), 8).token_ids(0) for p in PROMPTS]
    for max_length in (None, 8):  # 8: the buffer doubles while decoding, keeping what it holds
        runner = OrtRunner.from_decoder(decoder, max_length=max_length)
        out = drive([runner], ids, mask, 8, [Sampler()])[0]
        assert [out.token_ids(i) for i in range(3)] == alone, max_length
    assert runner.decoder.capacity == 16


def test_right_padded_moves_each_row_to_the_front():
    ids = np.array([[0, 0, 7, 8], [1, 2, 3, 4], [0, 0, 0, 9]])
    assert right_padded(ids, np.array([2, 4, 1])).tolist() == [[7, 8, 0, 0], [1, 2, 3, 4], [9, 0, 0, 0]]


def test_an_unpadded_batch_falls_back_to_the_prefill_decode_pair_when_share_cache_refuses(tiny, monkeypatch):
    from graphopt.backends.onnxruntime.decoder import inplace_cache
    from graphopt.errors import GraphoptError

    def refuse(*args, **kwargs):
        raise GraphoptError("attention x does not read a layer's returned key and value")

    monkeypatch.setattr(inplace_cache, "export_decoder", refuse)
    ids = torch.tensor([[5, 9, 11, 4], [6, 10, 14, 15]])
    runner = OrtRunner(tiny, Options.parse({"target": "onnxruntime"}))
    with pytest.raises(GraphoptError, match="does not read"):  # a padded batch has nowhere else to go
        runner.prepare(ids, torch.ones_like(ids))
    out = drive([runner], ids, None, 4, [Sampler()])[0]
    assert runner.decoder is None and runner.pads is False
    assert out.notes == ["prefill and decode run as two models: attention x does not read a layer's returned key "
                         "and value"]
    assert torch.equal(out.sequences, eager_generate(tiny, ids, 4).sequences)


def test_the_decoder_spins_and_torch_takes_one_thread_while_it_decodes(tiny, decoder):
    """OrtRunner's threads (backends/onnxruntime/decoder/decoder.py): the decoder's workers may spin
    between ops; during drive's loop torch computes on one thread, and the caller's count
    comes back after it, also when the loop raises."""
    runner = OrtRunner.from_decoder(decoder, max_length=16)
    options = runner.decoder.session.get_session_options()
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "1"
    before, seen = torch.get_num_threads(), []
    step = runner.step

    def spy(token, position):
        seen.append(torch.get_num_threads())
        return step(token, position)

    runner.step = spy
    ids = torch.tensor([PROMPTS[0]])
    out = drive([runner], ids, None, 4, [Sampler()])[0]
    assert seen == [1, 1, 1] and torch.get_num_threads() == before
    assert out.new_tokens.tolist() == eager_generate(tiny, ids, 4).new_tokens.tolist()

    def fail(token, position):
        raise RuntimeError("step failed")

    runner.step = fail
    with pytest.raises(RuntimeError, match="step failed"):
        drive([runner], ids, None, 4, [Sampler()])
    assert torch.get_num_threads() == before
