"""The on-disk cache of exported in-place decoders: a second runner on the same weights and
options loads the kept decoder; other weights or options, or a damaged entry, export again."""

import pytest
import torch

import graphopt
from graphopt import models
from graphopt.backends.onnxruntime.decoder import decoder_cache
from graphopt.backends.onnxruntime.decoder.decoder import OrtRunner
from graphopt.config import Options
from graphopt.generation import eager_generate

pytest.importorskip("onnxruntime")


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path))
    return tmp_path / "decoders"


@pytest.fixture()
def model():
    torch.manual_seed(0)
    return models.build("llama-tiny").eval()


IDS = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(2))


def _decode(model, new=5):
    """A fresh runner each time (as a new process would have), decoding IDS greedily."""
    graphopt.generation.forget(model)
    out = graphopt.generate(model, IDS, new, options={"target": "onnxruntime"})
    assert out.target == "onnxruntime", out.fallback
    return out


def test_a_second_runner_loads_the_kept_decoder(cache, model):
    first = _decode(model)
    assert any("kept the exported decoder" in n for n in first.notes), first.notes
    assert len(list(cache.iterdir())) == 1
    second = _decode(model)
    assert any("loaded the decoder exported by an earlier run" in n for n in second.notes), second.notes
    assert torch.equal(second.sequences, first.sequences)
    assert torch.equal(second.sequences, eager_generate(model, IDS, 5).sequences)
    # Where each run's compile time went: the export's stages, then only the key and the session.
    assert {"torch.export", "passes", "onnx export", "session", "cache store"} <= set(first.compile_stages)
    assert "torch.export" not in second.compile_stages and "session" in second.compile_stages
    for out in (first, second):
        assert 0 < sum(out.compile_stages.values()) <= out.compile_s
    # the second session saved the weights ORT packed (runtime/prepacked_copy.py); the third maps them
    (entry,) = cache.iterdir()
    assert len(list(entry.glob("model.prepacked-*.onnx"))) == 1
    third = _decode(model)
    assert torch.equal(third.sequences, first.sequences)
    assert any(n.startswith("mapped the weights ONNX Runtime packed") for n in third.notes), third.notes


def test_other_weights_or_options_export_again(cache, model):
    _decode(model)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.5)
    again = _decode(model)
    assert any("kept the exported decoder" in n for n in again.notes), again.notes
    assert torch.equal(again.sequences, eager_generate(model, IDS, 5).sequences)
    key = decoder_cache.decoder_key(model, Options.parse({"target": "onnxruntime"}).to_dict())
    assert key != decoder_cache.decoder_key(model, Options.parse({"target": "onnxruntime", "int4": True}).to_dict())
    assert len(list(cache.iterdir())) == 2


def test_a_damaged_entry_is_exported_again_and_replaced(cache, model):
    _decode(model)
    (entry,) = cache.iterdir()
    (entry / "model.onnx").write_bytes(b"not an onnx model")
    again = _decode(model)
    assert any("did not load" in n for n in again.notes), again.notes
    assert any("kept the exported decoder" in n for n in again.notes), again.notes
    assert torch.equal(again.sequences, eager_generate(model, IDS, 5).sequences)
    assert any("loaded the decoder" in n for n in _decode(model).notes)


def test_an_entry_keeps_its_weights_beside_the_model(cache, model):
    """Raw tensor bytes in model.onnx.data: writing them inline (one protobuf message) took
    SmolLM2's first run 10 s longer. A truncated data file is exported again, like a damaged model."""
    first = _decode(model)
    (entry,) = cache.iterdir()
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    data = entry / "model.onnx.data"
    assert data.stat().st_size > weights / 2, (data.stat().st_size, weights)
    assert (entry / "model.onnx").stat().st_size < data.stat().st_size / 4  # the graph, small constants
    with data.open("r+b") as f:
        f.truncate(data.stat().st_size // 2)
    again = _decode(model)
    assert any("did not load" in n for n in again.notes), again.notes
    assert torch.equal(again.sequences, first.sequences)


def test_off_keeps_nothing(monkeypatch, tmp_path, model):
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", "off")
    assert decoder_cache.cache_dir() is None
    out = _decode(model)
    assert not any("decoder" in n and ("kept" in n or "loaded" in n) for n in out.notes), out.notes


def test_least_recently_used_entries_go_over_the_size_limit(cache, monkeypatch, model):
    class Small:  # stands in for an OnnxModel: writes a file of a known size
        def __init__(self, size):
            self.size = size

        def save(self, path, external_data=None):
            path.write_bytes(b"x" * self.size)

    monkeypatch.setattr(decoder_cache, "KEEP_BYTES", 250)
    for key in ("a", "b", "c"):
        path, note = decoder_cache.store(key, Small(100))
        assert path is not None, note
    assert sorted(p.name for p in cache.iterdir()) == ["b", "c"]  # "a" was the least recently used
    assert decoder_cache.lookup("b") is not None and decoder_cache.lookup("a") is None


def test_a_decoder_that_cannot_be_kept_still_decodes(cache, model, monkeypatch):
    from graphopt.backends.onnxruntime.lower.onnx_model import OnnxModel

    def refuse(self, path, external_data=None):
        raise ValueError("planted: cannot serialize")

    monkeypatch.setattr(OnnxModel, "save", refuse)
    out = _decode(model)
    assert any("could not keep the exported decoder" in n and "planted" in n for n in out.notes), out.notes
    assert torch.equal(out.sequences, eager_generate(model, IDS, 5).sequences)
    assert not any(cache.iterdir())  # no half-written staging folder left behind
