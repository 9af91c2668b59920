"""graphopt.generate on a Checkpoint (a .gguf on its own weights): the decoder is exported in a
child process and kept; the next call opens it without building the model; the tokens are the
ones the lazy module decodes to on the same target."""

import pytest
import torch

import graphopt
from graphopt.sources import load_checkpoint, load_model
from tests.models.gguf_helpers import T, write_tiny

pytest.importorskip("onnxruntime")


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path / "cache"))
    return write_tiny(tmp_path / "tiny.gguf", "qwen2", {"ffn_down": T.Q4_K, "attn_q": T.Q5_0})


def test_a_checkpoint_decodes_and_its_decoder_is_kept(tiny):
    ids = torch.tensor([[5, 9, 14, 3]])
    checkpoint = load_checkpoint(str(tiny))
    built = []
    build = checkpoint.build
    checkpoint.build = lambda: built.append(1) or build()
    first = graphopt.generate(checkpoint, ids, 6, options={"target": "onnxruntime"})
    assert first.target == "onnxruntime" and first.fallback is None
    assert built == []  # built in the child, never here
    assert any("kept the exported decoder" in n for n in first.notes)
    second = graphopt.generate(checkpoint, ids, 6, options={"target": "onnxruntime"})
    assert any("loaded the decoder exported by an earlier run" in n for n in second.notes)
    assert second.token_ids(0) == first.token_ids(0) and built == []
    module = load_model(str(tiny), single_output=False).module  # the same lazy model, decoded as a module
    assert graphopt.generate(module, ids, 6, options={"target": "onnxruntime"}).token_ids(0) == first.token_ids(0)


def test_a_checkpoint_on_the_eager_target_builds_and_reads_its_weights(tiny):
    ids = torch.tensor([[5, 9, 14, 3]])
    out = graphopt.generate(load_checkpoint(str(tiny)), ids, 4, options={"target": "eager"})
    assert out.target == "eager" and len(out.token_ids(0)) == 4
    assert any("read" in n and "checkpoint tensors into memory" in n for n in out.notes)


def test_a_changed_file_is_another_checkpoint(tiny):
    first = load_checkpoint(str(tiny)).identity
    write_tiny(tiny, "qwen2", {"ffn_down": T.Q4_K}, seed=1)
    assert load_checkpoint(str(tiny)).identity != first
